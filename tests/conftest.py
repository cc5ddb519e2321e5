"""Set-up that must come before any test module is imported.

Hugging Face's `kernels` package (a dependency of transformers >= 5.25, which imports it)
first: this checkout's top-level `kernels/` folder (installed as `radixserve.kernels`)
is on the path of the test process, ahead of site-packages, and would be found in its
place (`_import_hf_kernels`).

The Triton kernels' tests need triton imported in the interpreter mode on CPU, and
transformers imports triton as a side effect: see `tests/kernels/interpreter.py`.
"""

import importlib.util
import sys
from pathlib import Path

import radixserve  # noqa: F401  # first: OpenMP's wait policy, set before torch loads

# isort: split

import pytest


def _import_hf_kernels() -> None:
    """Import the installed `kernels` distribution, if there is one, with this checkout
    off the path, so that later `import kernels` get it and not the folder."""
    root = Path(__file__).resolve().parent.parent
    saved = sys.path[:]
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != root]
    try:
        if importlib.util.find_spec("kernels") is not None:
            importlib.import_module("kernels")
    finally:
        sys.path[:] = saved


_import_hf_kernels()

from tests.kernels.interpreter import import_kernels  # noqa: E402

import_kernels()


@pytest.fixture(scope="session")
def hf_smol():
    """transformers' own load of the default GGUF in float32: the reference the model and
    engine tests match (loaded once). Its loader parses the file twice (config, then
    weights) and builds gguf's tensor-name map once per tensor (397 times): both are pure
    functions of their arguments, memoised here for the load (about 11 s instead of 21;
    the weights are the same tensors)."""
    import functools
    from unittest import mock

    import gguf
    import torch
    from transformers import AutoModelForCausalLM

    from radixserve.model.model_files import resolve_model_path

    path = resolve_model_path("default")
    with (
        mock.patch.object(gguf, "GGUFReader", functools.cache(gguf.GGUFReader)),
        mock.patch.object(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map)),
    ):
        return AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        ).eval()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The engine tests' tiny random model (`engine_helpers.TINY`: two layers, the
    default model's tokenizer and chat template) as a Hugging Face directory that worker
    processes load by path: for the process tests whose subject is the machinery
    (membership, faults, tier capacity, scaling), at a hundredth of the default model's
    cost per step. Tests of what users read (`radixserve up`, the CLI, the wheel, the
    images, the OpenAI features) keep the default model."""
    from tests.engine.engine_helpers import write_tiny_model

    return str(write_tiny_model(tmp_path_factory.mktemp("models") / "tiny-smollm2"))
