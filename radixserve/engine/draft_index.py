"""The draft index: the token sequences an engine's cache was given, per cache namespace,
indexed by their n-grams with the tokens that followed each and how often, so that
speculative decoding (`radixserve.engine.speculation`, method ``radix``) can draft the
continuation those texts agree on, each draft token with its evidence."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

#: the shortest n-gram matched (here and by prompt lookup)
MIN_NGRAM = 2
#: the n-gram lengths the draft index matches, the longest first (longer than prompt
#: lookup's: the index holds many texts, and a longer context tells which one a request
#: is repeating)
INDEX_MAX_NGRAM = 6
#: a draft token's evidence: the length of the n-gram it continues, and whether every
#: sequence that had that n-gram went on with it (`evidence_class`)
EVIDENCE_CLASSES = 2 * (INDEX_MAX_NGRAM - MIN_NGRAM + 1)
_TIMES = (1 << 32) - 1  # a packed continuation: token << 32 | times


def evidence_class(n: int, unanimous: bool) -> int:
    """The class of a draft token that continues an n-gram of ``n`` tokens (``unanimous``:
    every sequence that had it went on with that token)."""
    return 2 * (n - MIN_NGRAM) + unanimous


@dataclass
class _Sequences:
    """One namespace's sequences and, per n-gram (by its hash: a collision only makes a
    worse draft, which verification rejects), how often each token followed it."""

    sequences: OrderedDict[int, list[int]] = field(default_factory=OrderedDict)
    #: n-gram hash -> the tokens that followed it: while one token only, packed as
    #: ``token << 32 | times`` (most n-grams: a third of the memory of a map), else
    #: {next token: times seen} with the token seen last at the end
    nexts: dict[int, int | dict[int, int]] = field(default_factory=dict)

    def count(self, seq: list[int], step: int) -> None:
        """Add (``step`` 1) or take back (-1) ``seq``'s n-grams and their next tokens."""
        nexts = self.nexts
        for n in range(MIN_NGRAM, INDEX_MAX_NGRAM + 1):
            for end in range(n, len(seq)):  # an n-gram with a token after it
                key, token = hash(tuple(seq[end - n : end])), seq[end]
                seen = nexts.get(key)
                if isinstance(seen, dict):
                    times = seen.pop(token, 0) + step  # re-inserted: the last seen at the end
                    if times > 0:
                        seen[token] = times
                    if len(seen) == 1:
                        ((only, times),) = seen.items()
                        nexts[key] = only << 32 | times
                elif seen is not None and seen >> 32 != token:  # a second continuation
                    if step > 0:
                        nexts[key] = {seen >> 32: seen & _TIMES, token: step}
                else:
                    times = (0 if seen is None else seen & _TIMES) + step
                    if times > 0:
                        nexts[key] = token << 32 | times
                    elif seen is not None:
                        del nexts[key]

    def follow(self, tokens: Sequence[int], k: int) -> tuple[list[int], list[int]]:
        """Up to ``k`` tokens, each the one that most often followed the longest n-gram
        (of the tokens so far, the draft included) seen (ties: the one seen last), and
        each one's `evidence_class`."""
        context, draft, evidence = list(tokens[-INDEX_MAX_NGRAM:]), list[int](), list[int]()
        while len(draft) < k:
            for n in range(min(INDEX_MAX_NGRAM, len(context)), MIN_NGRAM - 1, -1):
                seen = self.nexts.get(hash(tuple(context[len(context) - n :])))
                if isinstance(seen, dict):
                    best = max(seen.values())
                    token = [t for t, c in seen.items() if c == best][-1]
                    evidence.append(evidence_class(n, False))
                    break
                if seen is not None:
                    token = seen >> 32
                    evidence.append(evidence_class(n, True))
                    break
            else:
                break
            draft.append(token)
            context = [*context[-INDEX_MAX_NGRAM + 1 :], token]
        return draft, evidence


class DraftIndex:
    """Token sequences the cache was given, per namespace, indexed by their n-grams
    (`MIN_NGRAM`..`INDEX_MAX_NGRAM`) with the tokens that followed each and how often; at most
    ``max_tokens`` tokens in all, the least recently added sequences dropped first. A
    draft is the most frequent continuation (the consensus of the requests that wrote
    the text). Text only: it holds no page and no KV."""

    def __init__(self, max_tokens: int = 1 << 20) -> None:
        self.max_tokens = max_tokens
        self._spaces: dict[bytes | None, _Sequences] = {}
        self._next_id = 0
        self._tokens = 0

    def add(self, namespace: bytes | None, tokens: Sequence[int]) -> None:
        if len(tokens) <= MIN_NGRAM:
            return
        space = self._spaces.setdefault(namespace, _Sequences())
        seq_id, self._next_id = self._next_id, self._next_id + 1
        seq = list(tokens[-self.max_tokens :])
        space.sequences[seq_id] = seq
        self._tokens += len(seq)
        space.count(seq, 1)
        while self._tokens > self.max_tokens:
            self._drop_oldest()

    def lookup(self, namespace: bytes | None, tokens: Sequence[int],
               k: int) -> tuple[list[int], list[int]]:  # fmt: skip
        """Up to ``k`` tokens continuing ``tokens`` as this namespace's sequences most
        often did, and each one's evidence (`_Sequences.follow`); nothing if its last
        tokens were never seen."""
        space = self._spaces.get(namespace)
        return ([], []) if space is None else space.follow(tokens, k)

    def _drop_oldest(self) -> None:
        oldest = min(
            (s for s in self._spaces.values() if s.sequences), key=lambda s: next(iter(s.sequences))
        )
        _, seq = oldest.sequences.popitem(last=False)
        self._tokens -= len(seq)
        oldest.count(seq, -1)

    @property
    def num_tokens(self) -> int:
        return self._tokens
