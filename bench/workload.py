"""The suite's workloads: what is sent, generated deterministically from a seed.

Scenario A (multi-turn support chat): one shared system prompt (the support policies
and store directory of `gateway_chat`), then per conversation ``rounds`` user turns of
``user_tokens`` tokens; each turn asks for an answer of ``answer_tokens`` tokens (the
model's real answer is appended to the history by the runner, not here).

Scenario B (RAG): ``num_docs`` knowledge-base articles sharing ``doc_tokens_total``
tokens, placed in the system message, and one short question per user.

Lengths are in tokens of the message text (the chat template adds ~5 per message) as
``count_tokens`` counts them: the runner passes the model's tokenizer, the unit tests a
word counter. Text is cut at a word boundary to the largest prefix that fits, so a
length lands within a token or two of its target. The same seed gives the same text.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import dataclass

from radixserve.bench.gateway_chat import QUESTIONS, system_prompt

CountTokens = Callable[[str], int]


@dataclass(frozen=True)
class MultiTurnSize:
    system_tokens: int
    rounds: int
    conversations: int
    user_tokens: tuple[int, int]  # inclusive range of one user turn
    answer_tokens: tuple[int, int]  # inclusive range of one answer (min_tokens = max_tokens)
    concurrency: int | None = None  # conversations at once; None: all of them


@dataclass(frozen=True)
class RagSize:
    num_docs: int
    doc_tokens_total: int
    users: int
    question_tokens: tuple[int, int]
    answer_tokens: tuple[int, int]
    concurrency: int = 4  # questions in flight at once


@dataclass(frozen=True)
class Preset:
    multi_turn: MultiTurnSize
    rag: RagSize
    kv_cache_gib: float  # per worker, so every conversation stays cached


PRESETS: dict[str, Preset] = {
    # A few minutes for both scenarios, cache on and off, on 2 CPU cores.
    "quick": Preset(
        multi_turn=MultiTurnSize(300, 4, 2, (12, 24), (16, 16)),
        rag=RagSize(3, 300, 4, (8, 16), (8, 8), concurrency=4),
        kv_cache_gib=0.25,
    ),
    # The founding table's shapes. Answers of 130-150 tokens (the top of its 50-150)
    # so that, with user turns of 20-60 tokens and ~10 template tokens a round, the
    # round-12 prompt lands at ~3,650 tokens: inside the table's 3,500-6,000.
    "seed": Preset(
        multi_turn=MultiTurnSize(1500, 12, 4, (20, 60), (130, 150)),
        rag=RagSize(5, 3000, 32, (10, 25), (20, 40), concurrency=8),
        kv_cache_gib=1.5,
    ),
}


@dataclass(frozen=True)
class Turn:
    user: str
    answer_tokens: int


@dataclass(frozen=True)
class MultiTurnWorkload:
    system: str
    conversations: tuple[tuple[Turn, ...], ...]


@dataclass(frozen=True)
class RagWorkload:
    system: str  # instructions followed by every document
    documents: tuple[str, ...]
    questions: tuple[Turn, ...]


def take_tokens(text: str, target: int, count_tokens: CountTokens, at_least: int = 0) -> str:
    """The longest word-boundary prefix of ``text`` with at most ``target`` tokens (at
    least one word); one word longer if that one has fewer than ``at_least``."""
    words = re.findall(r"\S+\s*", text)

    def count(n: int) -> int:
        return count_tokens("".join(words[:n]).rstrip())

    lo, hi = 1, len(words)  # invariant: the longest fitting prefix has lo..hi words
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if count(mid) <= target:
            lo = mid
        else:
            hi = mid - 1
    if count(lo) < at_least and lo < len(words):
        lo += 1
    return "".join(words[:lo]).rstrip()


def _grow(
    first: str, more: Callable[[], str], size: tuple[int, int], target: int, count: CountTokens
) -> str:
    """``first`` plus sentences from ``more`` until past ``target`` tokens, then cut to
    ``target`` (``size`` is the allowed range)."""
    text = first
    while count(text) <= target:
        text = f"{text} {more()}"
    return take_tokens(text, target, count, at_least=size[0])


_PLANS = ["Basic", "Plus", "Unlimited"]
_PHONES = ["Pixel 8", "iPhone 13", "Galaxy S23", "Fairphone 5", "Moto G54", "Nokia G42"]
_COUNTRIES = ["Switzerland", "Norway", "the United States", "Turkey", "Morocco", "Serbia"]
_STREETS = ["Market", "Station", "Harbour", "Church", "Mill", "Castle", "Garden", "Bridge"]
_DETAILS = [
    "I have been a customer for {n} years and I am on the {plan} plan.",
    "My phone is a {phone} that I bought {n} months ago.",
    "Last month my invoice was {euros} euros, which seemed high to me.",
    "I live near {street} Street, so the store there would suit me best.",
    "I travel to {country} about {n} times a year for work.",
    "My partner also has a line with you, the number ends in {digits}.",
    "I used about {gb} GB of data last month, mostly on video calls.",
    "I would rather not visit a store unless it is really necessary.",
    "Please keep the answer short, I am on my lunch break.",
    "A friend told me the {plan} plan changed recently, is that true?",
]


def _fill(template: str, rng: random.Random) -> str:
    return template.format(
        n=rng.randint(2, 9),
        plan=rng.choice(_PLANS),
        phone=rng.choice(_PHONES),
        euros=rng.randint(12, 90),
        street=rng.choice(_STREETS),
        country=rng.choice(_COUNTRIES),
        digits=rng.randint(1000, 9999),
        gb=rng.randint(3, 240),
    )


def _user_turn(rng: random.Random, size: tuple[int, int], count_tokens: CountTokens) -> str:
    target = rng.randint(*size)
    question = rng.choice(QUESTIONS)
    return _grow(question, lambda: _fill(rng.choice(_DETAILS), rng), size, target, count_tokens)


def support_system_prompt(num_tokens: int, count_tokens: CountTokens) -> str:
    """`gateway_chat`'s support policies and store directory, cut to ``num_tokens``."""
    stores = num_tokens // 45 + 1
    while count_tokens(system_prompt(stores)) <= num_tokens:
        stores += 4
    return take_tokens(system_prompt(stores), num_tokens, count_tokens)


def build_multi_turn(
    size: MultiTurnSize, seed: int, count_tokens: CountTokens
) -> MultiTurnWorkload:
    conversations = []
    for c in range(size.conversations):
        rng = random.Random(f"multi-turn/{seed}/{c}")
        turns = tuple(
            Turn(_user_turn(rng, size.user_tokens, count_tokens), rng.randint(*size.answer_tokens))
            for _ in range(size.rounds)
        )
        conversations.append(turns)
    return MultiTurnWorkload(support_system_prompt(size.system_tokens, count_tokens),
                             tuple(conversations))  # fmt: skip


_TOPICS = [
    ("Mobile plans", "plan"),
    ("Roaming and travel", "roaming option"),
    ("Devices and instalments", "device offer"),
    ("Invoices and payments", "payment method"),
    ("Home internet", "fibre package"),
    ("Insurance and repairs", "cover level"),
    ("Contracts and cancellation", "contract type"),
]
_NAMES = ["Orion", "Vega", "Lyra", "Nova", "Atlas", "Juno", "Rigel", "Sirius", "Talos", "Zephyr"]
_FACTS = [
    "The {kind} {name} costs {euros} euros a month and includes {gb} GB of data.",
    "Customers who choose {name} can switch to another {kind} once every {n} months.",
    "{name} is available in {n} regions and activates within {hours} hours.",
    "Since the last update, {name} no longer charges a setup fee of {euros} euros.",
    "A {kind} such as {name} can be cancelled online with {n} weeks of notice.",
    "{name} customers get priority support on weekdays between {n} and {hours} o'clock.",
    "Late changes to {name} cost {euros} euros and take {n} working days.",
    "The {kind} {name} is not combined with other discounts except the family bundle.",
]
_ASKS = [
    "How much does {name} cost per month?",
    "Can I cancel {name} online?",
    "How fast does {name} activate?",
    "Does {name} still have a setup fee?",
    "When can {name} customers reach priority support?",
    "What do late changes to {name} cost?",
]
_ASIDES = ["I am asking for my {rel}.", "Please answer in one sentence.", "Thanks in advance!",
           "I could not find it on the website.", "This is for a {rel} of mine."]  # fmt: skip
_RELATIVES = ["mother", "neighbour", "son", "colleague", "grandfather", "sister"]


def _aside(rng: random.Random) -> str:
    return rng.choice(_ASIDES).format(rel=rng.choice(_RELATIVES))


def _document(i: int, rng: random.Random, num_tokens: int, count_tokens: CountTokens) -> str:
    title, kind = _TOPICS[i % len(_TOPICS)]
    names = rng.sample(_NAMES, 3)

    def fact() -> str:
        return rng.choice(_FACTS).format(
            kind=kind, name=rng.choice(names), euros=rng.randint(5, 60), gb=rng.randint(5, 200),
            n=rng.randint(2, 12), hours=rng.randint(1, 48),
        )  # fmt: skip

    return _grow(f"Document {i + 1}: {title}.", fact, (0, num_tokens), num_tokens, count_tokens)


def build_rag(size: RagSize, seed: int, count_tokens: CountTokens) -> RagWorkload:
    rng = random.Random(f"rag/{seed}")
    per_doc = size.doc_tokens_total // size.num_docs
    docs = tuple(_document(i, rng, per_doc, count_tokens) for i in range(size.num_docs))
    names = re.findall(r"\b(" + "|".join(_NAMES) + r")\b", " ".join(docs)) or _NAMES
    questions = []
    for _ in range(size.users):
        target = rng.randint(*size.question_tokens)
        ask = rng.choice(_ASKS).format(name=rng.choice(names))
        text = _grow(ask, lambda: _aside(rng), size.question_tokens, target, count_tokens)
        questions.append(Turn(text, rng.randint(*size.answer_tokens)))
    system = (
        "You are the assistant of Northwind Telecom. Answer the customer's question from "
        "the documents below only; if they do not say, say so.\n\n" + "\n\n".join(docs)
    )
    return RagWorkload(system, docs, tuple(questions))
