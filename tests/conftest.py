"""Set-up that must come before any test module is imported, and how tests are grouped.

The Triton kernels' tests need triton imported in the interpreter mode on CPU, and
transformers imports triton as a side effect: see `tests/kernels/interpreter.py`.

`make test` runs the suite on two pytest-xdist workers (``--dist loadgroup``). Each test
is in one group, which one worker runs whole, in order: its module, or the shared cluster
its module names (``SHARED_CLUSTER``: tests/cluster/conftest.py), or ``hf_smol`` for the
modules that compare with transformers' load of the default model (25 s, loaded once).
Groups that start real processes go first, so that the end of the run is short tests
spread over both workers.
"""

from __future__ import annotations

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


_HF_SMOL_MODULES = ("tests/engine/test_default_model.py", "tests/model/test_checkpoint.py")


def _group(item: pytest.Item) -> str:
    module = getattr(item, "module", None)
    path = item.nodeid.split("::", 1)[0]
    if shared := getattr(module, "SHARED_CLUSTER", None):
        return f"cluster-{shared}"
    return "hf_smol" if path in _HF_SMOL_MODULES else path


def _rank(path: str) -> int:
    """Clusters first, then other tests that start processes, then the rest."""
    if path.startswith("tests/cluster/"):
        return 0
    return 1 if path.startswith(("tests/deploy/", "tests/bench/", "tests/test_")) else 2


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Each test in its group (see above); a group's tests next to each other, process
    groups first, the order otherwise kept."""
    first: dict[str, int] = {}
    for i, item in enumerate(items):
        group = _group(item)
        item.add_marker(pytest.mark.xdist_group(group))
        first.setdefault(group, i)
    items.sort(key=lambda it: (_rank(it.nodeid), first[_group(it)]))
