"""Prompts shared by the cluster tests: a system prompt long enough (> 256 tokens) that
a decode worker with the default `local_prefill_max_tokens` prefills it remotely."""

from __future__ import annotations

SYSTEM = (
    "You are the help desk of the Riverside public library. Answer in one or two short "
    "sentences. Opening hours: Monday to Friday nine to six, Saturday ten to four, closed "
    "on Sunday and public holidays. Members may borrow up to twelve books, four DVDs and "
    "two magazines at a time; books are lent for three weeks, DVDs for one week. Loans can "
    "be renewed twice online or at the desk unless another member has reserved the item. "
    "Late returns cost twenty cents a day per book and one euro a day per DVD, capped at "
    "ten euros per item. Study rooms for two to eight people can be booked up to fourteen "
    "days ahead for at most three hours a day. Printing costs ten cents a page in black "
    "and white and fifty cents in colour; scanning is free. The children's corner hosts "
    "story time every Wednesday at four and Saturday at eleven. Wi-Fi is free; the network "
    "is called Riverside-Guest and needs no password. Lost cards are replaced for two "
    "euros. Donations of books in good condition are welcome on Tuesdays. The cafe on the "
    "ground floor opens an hour after the library and closes an hour before it. Quiet "
    "reading is on the second floor; group work on the first floor only. "
)

QUESTIONS = [
    "When do you open on Saturday?",
    "Can I renew a book online?",
    "How much is the fine for a late DVD?",
    "Do I need a password for the Wi-Fi?",
    "How many people fit in a study room?",
    "When is story time?",
    "What does colour printing cost?",
    "Where can I work with a group?",
]


def chat(question: str, system: str = SYSTEM) -> list[dict[str, str]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


def long_conversation(tag: str, turns: int) -> list[dict[str, str]]:
    """A chat of ``turns`` user turns over a long system prompt (about 2,900 tokens) headed
    by ``tag`` (a fresh one shares no cache with another run), earlier turns answered
    "Answer <i>."."""
    messages = [{"role": "system", "content": f"[{tag}] " + SYSTEM * 11}]
    for i in range(turns):
        if i:
            messages.append({"role": "assistant", "content": f"Answer {i}."})
        messages.append({"role": "user", "content": QUESTIONS[i]})
    return messages
