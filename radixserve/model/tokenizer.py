"""The model's tokenizer: a `tokenizers.Tokenizer` plus special ids and a chat template.

Built either from a Hugging Face `tokenizer.json` or from the `tokenizer.ggml.*` metadata
of a GGUF file. Only byte-level BPE GGUF vocabularies (`tokenizer.ggml.model == "gpt2"`)
are supported; the pre-tokenizer is picked from `tokenizer.ggml.pre` to match the one
the model's own Hugging Face tokenizer uses (the model families declare theirs:
`radixserve.model.families`).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors

from radixserve.errors import InvalidRequestError, ModelLoadError
from radixserve.model.chat_template import ChatTemplate
from radixserve.model.families.family import PreTokenizer
from radixserve.model.families.registry import pre_tokenizer

logger = logging.getLogger(__name__)

# llama.cpp token types (gguf.TokenType): 3 is CONTROL, 4 is USER_DEFINED.
_CONTROL, _USER_DEFINED = 3, 4


def _byte_level_pre_tokenizer(spec: PreTokenizer | None) -> pre_tokenizers.PreTokenizer:
    """A GGUF vocabulary's pre-tokenizer: its family's (`PreTokenizer`), GPT-2's if None."""
    if spec is None:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    steps: list[pre_tokenizers.PreTokenizer] = []
    if spec.digits:
        steps.append(pre_tokenizers.Digits(individual_digits=True))
    if spec.split is not None:
        steps.append(pre_tokenizers.Split(Regex(spec.split), behavior="isolated"))
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=spec.split is None))
    return pre_tokenizers.Sequence(steps)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte → printable character table."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


@functools.lru_cache(maxsize=1)
def _unicode_to_bytes() -> dict[str, int]:
    return {ch: b for b, ch in _bytes_to_unicode().items()}


class Tokenizer:
    """Text ⇄ token ids, special ids and the chat template of one model.

    Contracts: `encode` adds whatever the underlying post-processor adds when
    `add_special_tokens` is true (a BOS for models that want one) and nothing otherwise;
    a prompt rendered by `apply_chat_template` already holds its special tokens, so
    encode it with `add_special_tokens=False`. Special tokens in the text (e.g.
    `<|im_start|>`) always encode to their single id. Instances are read-only.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token_id: int | None = None,
        eos_token_ids: Sequence[int] = (),
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
    ) -> None:
        self._backend = backend
        self._bos_token_id = bos_token_id
        self._eos_token_ids = tuple(dict.fromkeys(int(i) for i in eos_token_ids))
        self._template = ChatTemplate(chat_template) if chat_template else None
        if bos_token is None and bos_token_id is not None:
            bos_token = backend.id_to_token(bos_token_id)
        if eos_token is None and self._eos_token_ids:
            eos_token = backend.id_to_token(self._eos_token_ids[0])
        self._bos_token = bos_token
        self._eos_token = eos_token

    # -- construction ---------------------------------------------------------------

    @classmethod
    def from_file(
        cls,
        path: str | Path,
        *,
        bos_token: str | None = None,
        eos_tokens: Sequence[str] = (),
        eos_token_ids: Sequence[int] = (),
        bos_token_id: int | None = None,
        chat_template: str | None = None,
        add_bos_token: bool | None = None,
    ) -> Tokenizer:
        """From a Hugging Face `tokenizer.json`.

        Special tokens may be given as text (`bos_token`, `eos_tokens`) or ids; text that
        is not in the vocabulary is ignored with a warning. `add_bos_token=True` makes
        `encode` prepend the BOS whatever the file's post-processor says.
        """
        try:
            backend = tokenizers.Tokenizer.from_file(str(path))
        except Exception as exc:
            raise ModelLoadError(f"cannot read tokenizer {path}: {exc}") from exc
        if bos_token_id is None and bos_token is not None:
            bos_token_id = backend.token_to_id(bos_token)
        eos_ids = list(eos_token_ids)
        for text in eos_tokens:
            token_id = backend.token_to_id(text)
            if token_id is None:
                logger.warning("eos token %r is not in the vocabulary of %s", text, path)
            else:
                eos_ids.append(token_id)
        if add_bos_token and bos_token_id is not None:
            cls._install_bos(backend, bos_token_id)
        try:
            return cls(
                backend,
                bos_token_id=bos_token_id,
                eos_token_ids=eos_ids,
                chat_template=chat_template,
                bos_token=bos_token,
                eos_token=eos_tokens[0] if eos_tokens else None,
            )
        except ModelLoadError as exc:
            raise ModelLoadError(f"{path}: {exc}") from exc

    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping[str, Any]) -> Tokenizer:
        """From GGUF metadata values (`tokenizer.ggml.*`, `tokenizer.chat_template`).

        Raises ModelLoadError for a missing or unsupported vocabulary.
        """
        kind = metadata.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ModelLoadError(
                f"unsupported GGUF tokenizer model {kind!r} (only byte-level BPE 'gpt2')"
            )
        tokens = list(metadata.get("tokenizer.ggml.tokens") or ())
        merges = list(metadata.get("tokenizer.ggml.merges") or ())
        if not tokens or not merges:
            raise ModelLoadError("GGUF file has no tokenizer vocabulary or merges")
        types = list(metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens))
        flagged = (_CONTROL, _USER_DEFINED)
        special = {i for i, kind in enumerate(types[: len(tokens)]) if kind in flagged}
        spelling = _bytes_to_unicode()
        alphabet = set(spelling.values())
        vocab: dict[str, int] = {}
        for i, token in enumerate(tokens):
            if i not in special and not set(token) <= alphabet:
                token = "".join(spelling[b] for b in token.encode("utf-8"))
            vocab.setdefault(token, i)
        pairs = []
        for merge in merges:
            parts = merge.split(" ")
            if len(parts) != 2:
                raise ModelLoadError(f"malformed GGUF merge {merge!r}")
            pairs.append((parts[0], parts[1]))
        pre = str(metadata.get("tokenizer.ggml.pre", "default"))
        spec = pre_tokenizer(pre)  # the model family's (`radixserve.model.families`)
        if spec is None and pre not in ("default", "gpt2", ""):
            raise ModelLoadError(f"unsupported GGUF pre-tokenizer {pre!r}")
        backend = tokenizers.Tokenizer(
            models.BPE(
                vocab=vocab, merges=pairs, ignore_merges=spec is not None and spec.ignore_merges
            )
        )
        backend.pre_tokenizer = _byte_level_pre_tokenizer(spec)
        if spec is not None and spec.nfc:
            backend.normalizer = normalizers.NFC()
        backend.decoder = decoders.ByteLevel()
        control = [i for i in sorted(special) if types[i] == _CONTROL]
        user = [i for i in sorted(special) if types[i] != _CONTROL]
        backend.add_special_tokens([AddedToken(tokens[i], normalized=False) for i in control])
        backend.add_tokens([AddedToken(tokens[i], normalized=False, special=False) for i in user])
        bos_id = metadata.get("tokenizer.ggml.bos_token_id")
        eos_keys = [f"tokenizer.ggml.{kind}_token_id" for kind in ("eos", "eot", "eom")]
        eos_ids = [metadata[key] for key in eos_keys if metadata.get(key) is not None]
        if metadata.get("tokenizer.ggml.add_bos_token") and bos_id is not None:
            cls._install_bos(backend, int(bos_id))
        return cls(
            backend,
            bos_token_id=None if bos_id is None else int(bos_id),
            eos_token_ids=eos_ids,
            chat_template=metadata.get("tokenizer.chat_template"),
        )

    @staticmethod
    def _install_bos(backend: tokenizers.Tokenizer, bos_id: int) -> None:
        bos = backend.id_to_token(bos_id)
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
        )

    # -- use --------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce, added tokens included."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_token_id

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every id that ends a generation (may be empty)."""
        return self._eos_token_ids

    @property
    def chat_template(self) -> str | None:
        return self._template.source if self._template else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch releases the GIL while it works (encode holds it: a 6 MiB prompt
        # froze every other thread for 4 s), so the gateway's loop keeps serving while
        # a preparation worker tokenizes; same ids, no slower for one text.
        batch = self._backend.encode_batch([text], add_special_tokens=add_special_tokens)
        ids: list[int] = batch[0].ids
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for: a byte-level BPE piece maps back through GPT-2's
        byte table (so a piece holding half a UTF-8 character gives those bytes); other
        tokens give their decoded text."""
        piece = self._backend.id_to_token(token_id)
        if piece is None:
            return b""
        table = _unicode_to_bytes()
        if all(ch in table for ch in piece):
            return bytes(table[ch] for ch in piece)
        return self.decode([token_id], skip_special_tokens=False).encode("utf-8")

    def to_json(self) -> str:
        """The tokenizer as Hugging Face tokenizer.json text (for grammar engines)."""
        return str(self._backend.to_str())

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """The prompt text for a conversation (see `ChatTemplate.render`).

        Raises InvalidRequestError when the model has no chat template, the messages
        are malformed, or the template rejects them.
        """
        if self._template is None:
            raise InvalidRequestError("model has no chat template")
        return self._template.render(
            messages,
            add_generation_prompt,
            bos_token=self._bos_token,
            eos_token=self._eos_token,
            **kwargs,
        )

    def encode_chat(
        self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any
    ) -> list[int]:
        """Token ids of a conversation rendered with the chat template (``kwargs``: extra
        template variables). The template writes its own special tokens, so none are
        added on top (no second BOS)."""
        text = self.apply_chat_template(messages, add_generation_prompt, **kwargs)
        return self.encode(text, add_special_tokens=False)

    def __repr__(self) -> str:
        return (
            f"Tokenizer(vocab_size={self.vocab_size}, bos={self._bos_token_id}, "
            f"eos={self._eos_token_ids}, chat_template={self._template is not None})"
        )
