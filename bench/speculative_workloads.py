"""`--scenario speculative`'s workloads, generated from a seed: chat conversations whose
answers repeat text (the prompt's, or an earlier request's answer) and one whose
answers do not.

A workload is a list of `Conversation`s; each has turns, and a turn's messages are built
from the answers of the turns before it (the agentic workload feeds the model's answer
back into the next prompt). ``primes``: conversations run once before the measured ones
(one at a time, unmeasured, alike for every method): the cross-request workload's first
askers, whose answers the later askers want again.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

Messages = list[dict[str, str]]
#: the messages of a turn, given the answers of the conversation's earlier turns
TurnBuilder = Callable[[list[str]], Messages]

WORKLOADS = ("rag", "code-edit", "agentic", "cross-request", "open-chat")


@dataclass
class Conversation:
    turns: list[TurnBuilder]


@dataclass
class Workload:
    name: str
    conversations: list[Conversation]
    primes: list[Conversation] = field(default_factory=list)


def single_turn(messages: Messages) -> Conversation:
    """A one-turn conversation of fixed messages."""
    return Conversation([lambda _: messages])


def user_says(content: str) -> Conversation:
    return single_turn([{"role": "user", "content": content}])


_NAMES = ("Harlow", "Brenton", "Ashcombe", "Quillon", "Marsden", "Thorne", "Velby", "Corrin",
          "Dunmore", "Ellery", "Fenwick", "Galloway", "Hartley", "Iverson", "Kestrel")  # fmt: skip
_PEOPLE = ("Margaret Ellis", "Tomas Reyes", "Ada Whitfield", "Henrik Olsen", "Priya Raman",
           "Jonah Keller", "Lucia Ferrant", "Samuel Ode", "Irene Novak", "Walter Finch")  # fmt: skip
_KINDS = ("bridge", "library", "observatory", "lighthouse", "museum", "canal", "railway")
_RIVERS = ("Tane", "Orrin", "Wyle", "Caddon", "Lisk", "Morrow")


def _document(rng: random.Random) -> tuple[str, str, list[tuple[str, str]]]:
    """A made-up document: (title, text, (question, the sentence answering it))."""
    name, kind = rng.choice(_NAMES), rng.choice(_KINDS)
    title = f"The {name} {kind.capitalize()}"
    built, restored = rng.randint(1790, 1910), rng.randint(1950, 2015)
    person, river = rng.choice(_PEOPLE), rng.choice(_RIVERS)
    visitors, cost = rng.randint(20, 900) * 1000, rng.randint(2, 90) * 10000
    facts = [
        (f"Who built {title.lower()}?", f"{title} was built in {built} by {person}, who "
         f"designed it to serve the towns along the river {river}."),
        (f"What happened to {title.lower()} in {restored}?", f"In {restored} {title.lower()} "
         f"was restored after a storm damaged its roof, at a cost of {cost} pounds."),
        (f"How many people visit {title.lower()}?", f"Today {title.lower()} receives about "
         f"{visitors} visitors a year and is open every day except Monday."),
        (f"What is {title.lower()} known for?", f"{title} is known for its seven stone "
         f"arches and for the clock that has kept time since {built + rng.randint(3, 40)}."),
    ]  # fmt: skip
    return title, " ".join(sentence for _, sentence in facts), facts


def rag(rng: random.Random, count: int) -> Workload:
    """A few shared documents; each question's answer is a sentence of one of them."""
    docs = [_document(rng) for _ in range(3)]
    context = "\n\n".join(f"## {title}\n{text}" for title, text, _ in docs)
    system = ("Answer the question by quoting the sentence of the documents that answers "
              "it, word for word.")  # fmt: skip
    questions = [q for _, _, facts in docs for q, _ in facts]
    rng.shuffle(questions)

    def ask(question: str) -> Conversation:
        return single_turn([{"role": "system", "content": system},
                            {"role": "user", "content": f"Documents:\n\n{context}\n\n"
                             f"Question: {question} Quote the document."}])  # fmt: skip

    return Workload("rag", [ask(questions[i % len(questions)]) for i in range(count)])


_VERBS = ("load", "parse", "merge", "count", "filter", "render", "score", "split", "check",
          "update", "build", "format", "collect", "resolve", "encode", "measure")  # fmt: skip
_NOUNS = ("orders", "records", "tokens", "users", "events", "prices", "rows", "labels",
          "files", "items", "scores", "names", "blocks", "routes", "tasks", "notes")  # fmt: skip


def python_file(rng: random.Random, num_functions: int = 14) -> tuple[str, list[str]]:
    """A synthetic Python module of about 150 lines and its functions' names."""
    names = rng.sample([f"{v}_{n}" for v in _VERBS for n in _NOUNS], num_functions)
    lines = ['"""Helpers for the inventory reports."""', "", "import json", "", ""]
    for name in names:
        arg, key, limit = rng.choice(_NOUNS), rng.choice(_NOUNS)[:-1], rng.randint(2, 99)
        lines += [
            f"def {name}({arg}, limit={limit}):",
            f'    """Return the {key} values of {arg}, at most {limit}."""',
            "    result = []",
            f"    for entry in {arg}:",
            f'        if entry.get("{key}") is None:',
            "            continue",
            f'        result.append(entry["{key}"])',
            "        if len(result) >= limit:",
            "            break",
            "    return result",
            "",
        ]  # fmt: skip
    return "\n".join(lines) + "\n", names


def code_edit(rng: random.Random, count: int) -> Workload:
    """'Return this file with one function renamed' on a generated ~150-line file."""
    conversations = []
    for _ in range(count):
        source, names = python_file(rng)
        old = rng.choice(names)
        new = f"{rng.choice(_VERBS)}_all_{rng.choice(_NOUNS)}"
        content = (f"Here is a Python file:\n```python\n{source}```\nReturn this file with "
                   f"the function `{old}` renamed to `{new}`. Reply with the whole file "
                   "in a code block and nothing else.")  # fmt: skip
        conversations.append(user_says(content))
    return Workload("code-edit", conversations)


_TOOLS = ("get_order_status", "read_log_tail", "list_directory", "query_inventory")


def _tool_output(rng: random.Random, tool: str) -> str:
    if tool == "get_order_status":
        return "\n".join(f"order {rng.randint(1000, 9999)}: {rng.choice(('shipped', 'packed', 'delayed'))}"
                         f", {rng.randint(1, 40)} items, carrier {rng.choice(_NAMES)} Freight"
                         for _ in range(4))  # fmt: skip
    if tool == "read_log_tail":
        return "\n".join(f"2026-11-{rng.randint(10, 28)} 0{rng.randint(1, 9)}:{rng.randint(10, 59)} "
                         f"{rng.choice(('INFO', 'WARN', 'ERROR'))} worker {rng.randint(1, 9)} "
                         f"{rng.choice(_VERBS)}ed {rng.randint(2, 500)} {rng.choice(_NOUNS)}"
                         for _ in range(4))  # fmt: skip
    if tool == "list_directory":
        return "\n".join(f"{rng.choice(_VERBS)}_{rng.choice(_NOUNS)}.py  {rng.randint(1, 90)} KB"
                         for _ in range(5))  # fmt: skip
    return "\n".join(f"{rng.choice(_NOUNS)}: {rng.randint(0, 500)} in stock at "
                     f"{rng.choice(_NAMES)} warehouse" for _ in range(4))  # fmt: skip


def agentic(rng: random.Random, count: int, turns: int = 3) -> Workload:
    """Multi-turn tool use: each turn shows a tool's output, and the answer repeats it."""
    system = ("You are an operations assistant. When a tool returns output, show the user "
              "the tool's output exactly as returned, then add one sentence of summary.")  # fmt: skip
    conversations = []
    for _ in range(count):
        calls = [(tool, _tool_output(rng, tool)) for tool in rng.choices(_TOOLS, k=turns)]

        def builder(t: int, calls: list[tuple[str, str]] = calls) -> TurnBuilder:
            def messages(answers: list[str]) -> Messages:
                out = [{"role": "system", "content": system}]
                for i in range(t + 1):
                    tool, result = calls[i]
                    out.append({"role": "user", "content": f"I ran the tool `{tool}`. It "
                                f"returned:\n{result}\nShow me what it returned."})  # fmt: skip
                    if i < t:
                        out.append({"role": "assistant", "content": answers[i]})
                return out

            return messages

        conversations.append(Conversation([builder(t) for t in range(turns)]))
    return Workload("agentic", conversations)


_TOPICS = ("the water cycle", "how a bicycle gear works", "why the sky is blue",
           "how vaccines train the immune system", "how a refrigerator keeps food cold",
           "what causes the seasons", "how a compass finds north", "how bread rises",
           "how solar panels make electricity", "why leaves change colour in autumn")  # fmt: skip
#: the same request in users' own small variations (a 135M model's greedy answers to
#: bigger rewordings part after a few words): the first is the prime's, each later user
#: of a topic has one of the others
_ASKS = ("Explain {topic} in one short paragraph.",
         "explain {topic} in one short paragraph",
         "Explain {topic} in one short paragraph, thanks.",
         "Hi! Explain {topic} in one short paragraph.",
         "Explain {topic} in one short paragraph please.",
         "Explain {topic} in one short paragraph!",
         "Please explain {topic} in one short paragraph.",
         "Explain {topic} in one short paragraph, please.",
         "Hello! Explain {topic} in one short paragraph.",
         "Explain {topic} in a short paragraph.")  # fmt: skip
#: users asking each topic's question (after its prime)
USERS_PER_TOPIC = 8


def cross_request(rng: random.Random, count: int) -> Workload:
    """Many users ask for the same short explanation in their own words: the text is in
    no prompt, but the first asker's answer (a prime) is in the engine's draft index."""
    topics = rng.sample(_TOPICS, max(1, min(len(_TOPICS), -(-count // USERS_PER_TOPIC))))
    primes = [user_says(_ASKS[0].format(topic=t)) for t in topics]
    conversations = []
    for i in range(count):
        ask = _ASKS[1 + i % (len(_ASKS) - 1)].format(topic=topics[i % len(topics)])
        conversations.append(user_says(ask))
    return Workload("cross-request", conversations, primes)


_OPEN = ("Give me three tips for {a}.", "Write a short story about {b}.",
         "What should I consider when {a}?", "Describe a day in the life of {b}.",
         "Write a limerick about {b}.", "What are the pros and cons of {a}?")  # fmt: skip
_ACTIVITIES = ("learning to swim", "planting tomatoes", "buying a used car", "running a "
               "marathon", "moving to a new city", "learning the violin", "baking sourdough",
               "starting a book club", "adopting a cat", "painting a room")  # fmt: skip
_SUBJECTS = ("a lighthouse keeper", "a lost umbrella", "a clockmaker", "a curious fox",
             "a retired astronaut", "a street musician", "a snowy owl", "a night train")  # fmt: skip


def open_chat(rng: random.Random, count: int) -> Workload:
    """Distinct everyday questions: nothing to copy from."""
    asks = [rng.choice(_OPEN).format(a=rng.choice(_ACTIVITIES), b=rng.choice(_SUBJECTS))
            for _ in range(count)]  # fmt: skip
    return Workload("open-chat", [user_says(q) for q in asks])


_BUILDERS = {"rag": rag, "code-edit": code_edit, "agentic": agentic,
             "cross-request": cross_request, "open-chat": open_chat}  # fmt: skip


def build_workload(name: str, seed: int, count: int) -> Workload:
    """``count`` conversations of workload ``name`` from ``seed``."""
    return _BUILDERS[name](random.Random(f"{name}:{seed}"), count)
