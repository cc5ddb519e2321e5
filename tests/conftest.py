"""Set-up that must come before any test module is imported.

The Triton kernels' tests need triton imported in the interpreter mode on CPU, and
transformers imports triton as a side effect: see `tests/kernels/interpreter.py`.
"""

import pytest

from tests.kernels.interpreter import import_kernels

import_kernels()


@pytest.fixture(scope="session")
def hf_smol():
    """transformers' own load of the default GGUF in float32: the reference the model and
    engine tests match (it dequantizes in Python, about 25 s: loaded once)."""
    import torch
    from transformers import AutoModelForCausalLM

    from radixserve.model.model_files import resolve_model_path

    path = resolve_model_path("default")
    return AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
