"""Session-wide fixtures: the default model, loaded once by us and once by transformers."""

from __future__ import annotations

import pytest

from radixserve.model.checkpoint import Checkpoint, load_checkpoint


@pytest.fixture(scope="session")
def default_checkpoint() -> Checkpoint:
    return load_checkpoint("default", progress=False)


@pytest.fixture(scope="session")
def hf_gguf_tokenizer(default_checkpoint):
    """transformers' own tokenizer for the default GGUF (the reference we match)."""
    from transformers import AutoTokenizer

    path = default_checkpoint.path
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
