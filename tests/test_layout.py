"""The tree's boundaries, checked from the source: the import graph of the installed
packages has no cycle (counting imports inside functions and under TYPE_CHECKING, which
only hide one); nothing outside the engine package imports the engine, its scheduler or
its KV pool; and the cluster gateway runs without torch."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# source folder -> the name it installs under (pyproject's package-dir)
PACKAGES = {"radixserve": "radixserve", "kernels": "radixserve.kernels",
            "services": "radixserve.services", "bench": "radixserve.bench"}  # fmt: skip


def modules() -> dict[str, Path]:
    found = {}
    for folder, name in PACKAGES.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([name, *parts])] = path
    return found


def imports(path: Path, module: str, known: set[str]) -> set[str]:
    """The tree's modules ``module`` imports anywhere in its file."""
    out = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1]
                                + ([base] if base else []))  # fmt: skip
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                     for alias in node.names]  # fmt: skip
        out.update(name for name in names if name in known and name != module)
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_the_import_graph_has_no_cycle() -> None:
    mods = modules()
    graph = {name: imports(path, name, set(mods)) for name, path in mods.items()}
    assert sum(len(edges) for edges in graph.values()) > 300  # the walk sees the imports
    assert cycles(graph) == []


def test_a_cycle_is_found() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


ENGINE_INTERNALS = {"radixserve.engine.engine": {"Engine"},
                    "radixserve.engine.scheduler": {"Scheduler"},
                    "radixserve.cache.kv_pool": {"KVPool"}}  # fmt: skip


def test_only_the_engine_package_touches_the_engine() -> None:
    """Services, the runtime, the launch code and the CLI reach the engine through
    `AsyncEngine` (its operations, `info`, `stats`): none imports `Engine`, `Scheduler`
    or `KVPool`. (The benchmarks and tests drive the engine directly: that is what they
    measure and check.)"""
    offenders = []
    for name, path in modules().items():
        if name.startswith(("radixserve.engine", "radixserve.bench", "radixserve.cache.kv_pool")):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module in ENGINE_INTERNALS:
                offenders.append(f"{name} imports {node.module}")
            if isinstance(node, ast.Attribute) and node.attr in ("scheduler", "kv_pool"):
                offenders.append(f"{name} reads .{node.attr}")
    assert offenders == []


def test_the_cluster_gateway_imports_neither_torch_nor_the_engine() -> None:
    code = (
        "import sys\n"
        "from radixserve.services.gateway import GatewaySettings, build_client, create_app\n"
        "from radixserve.services.gateway.__main__ import main\n"
        "from radixserve.settings import EngineSettings\n"
        "s = GatewaySettings(kvstore='tcp://127.0.0.1:9')\n"
        "client = build_client(s, EngineSettings())\n"
        "create_app(client, s)\n"
        "assert client.max_model_len > 0 and client.tokenizer.encode('hi')\n"
        "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith(('torch.', "
        "'radixserve.engine.engine', 'radixserve.engine.async_engine')))\n"
        "print(bad)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "[]"


#: the allocator and the radix tree: only the cache package and the cache manager
#: import them (a type named in an annotation, under TYPE_CHECKING, holds no page)
PAGE_STATE = {"radixserve.cache.page_allocator", "radixserve.cache.radix_cache",
              "radixserve.cache.radix_tree"}  # fmt: skip
PAGE_OWNERS = ("radixserve.cache.", "radixserve.engine.kv_cache_manager")
BENCHMARKS = ("radixserve.bench", "radixserve.kernels.bench")  # drive the parts directly


def runtime_imports(path: Path) -> set[str]:
    """The absolute module names ``path`` imports outside ``if TYPE_CHECKING:`` blocks
    (functions' imports included)."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    return found


def test_only_the_cache_manager_imports_the_allocator_and_the_radix_tree() -> None:
    """`KVCacheManager` is the one owner of the pool's pages: the scheduler, the engine,
    the leases, the audit, the runtime and the services reach pages through it."""
    offenders = sorted(
        f"{name} imports {imported}"
        for name, path in modules().items()
        if not name.startswith(PAGE_OWNERS + BENCHMARKS)
        for imported in runtime_imports(path) & PAGE_STATE
    )
    assert offenders == []
    kv = modules()["radixserve.engine.kv_cache_manager"]
    assert runtime_imports(kv) >= PAGE_STATE  # the rule sees the imports it forbids


def test_neither_the_scheduler_nor_the_cache_manager_imports_kernels() -> None:
    """The page-run size (the CPU decode attention's block) is passed in by the engine:
    what pages a request gets is not tied to one kernel's module."""
    mods = modules()
    engine = imports(mods["radixserve.engine.engine"], "radixserve.engine.engine", set(mods))
    assert any(name.startswith("radixserve.kernels") for name in engine)  # the walk sees them
    for name in ("radixserve.engine.scheduler", "radixserve.engine.kv_cache_manager"):
        found = imports(mods[name], name, set(mods))
        assert sorted(m for m in found if m.startswith("radixserve.kernels")) == [], name


ARCH_NAME = re.compile(r"(^|_)arch(itecture)?s?$")


def arch_tests(source: str) -> list[str]:
    """The comparisons (==, !=, in, not in) in ``source`` that test a value named
    ``arch``, ``architecture``, ``*_arch`` … (a model family told by its name)."""

    def named(node: ast.expr) -> bool:
        name = getattr(node, "id", None) or getattr(node, "attr", None)
        return isinstance(name, str) and bool(ARCH_NAME.search(name))

    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        if any(isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn)) for op in node.ops) and any(
            named(x) for x in (node.left, *node.comparators)
        ):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_only_the_family_registry_tells_families_by_name() -> None:
    """A model family's differences live in its module of `radixserve.model.families`:
    no code elsewhere tests an architecture's name (``arch == "gemma3"``)."""
    families = ROOT / "radixserve" / "model" / "families"
    offenders = [
        f"{path.relative_to(ROOT)}:{hit}"
        for folder in ("radixserve", "services")
        for path in sorted((ROOT / folder).rglob("*.py"))
        if families not in path.parents
        for hit in arch_tests(path.read_text())
    ]
    assert offenders == []


def test_an_architecture_test_is_found() -> None:
    code = (
        "if config.architecture == 'mixtral': pass\n"
        "ok = arch in ('qwen3', 'gemma3')\n"
        "x = gguf_arch != 'llama'\n"
        "y = size == 3\n"
    )
    assert [hit.split(":")[0] for hit in arch_tests(code)] == ["1", "2", "3"]
