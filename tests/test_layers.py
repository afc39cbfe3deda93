"""The package's import graph: no cycles between modules, and imports only downward through the layers
(README, "What it is"). Read from the source with ast, lazy imports inside functions included: a lazy
import is still a dependency, only a later one."""
from __future__ import annotations

import ast
from pathlib import Path

import ggml_dist

PACKAGE = Path(ggml_dist.__file__).parent

# bottom to top; a module may import its own layer and those below. serve and bench are side by side:
# neither imports the other. cli (with config, its run-config files) is the command on top of everything.
LAYERS = [("core",), ("alloc",), ("backends",), ("scheduler",), ("model",), ("workers", "testbed"), ("runtime",),
          ("serve", "bench"), ("config",), ("serve_args",), ("cli",)]
RANK = {name: i for i, names in enumerate(LAYERS) for name in names}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """module -> the ggml_dist modules it imports (a `from pkg import name` counts pkg.name when that is
    a module, else pkg)."""
    paths = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in paths}
    for mod, path in paths.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                    base = ".".join(up + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in paths else base for a in node.names]
            else:
                continue
            graph[mod] |= {t for t in targets if t in paths and t != mod}
    return graph


def layer(mod: str) -> str:
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_no_import_cycles():
    graph = import_graph()
    state: dict[str, int] = {}          # 1 on the current path, 2 done

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                cycle = [*path[path.index(n):], n] if n in path else [m, n]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if n not in state:
                visit(n, [*path, n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])


def test_model_reaches_the_host_backend_through_its_face():
    """model/ imports no module of backends/cpu: what a model needs of the host's kernels is backends/host.py's,
    so a second backend touches no file of model/."""
    graph = import_graph()
    bad = sorted(f"{a} imports {b}" for a, targets in graph.items() for b in targets
                 if a.startswith("ggml_dist.model.") and b.startswith("ggml_dist.backends.cpu"))
    assert not bad, "\n".join(bad)


def test_serve_and_bench_reach_the_workers_through_the_runtime_face():
    """Where a model runs (this process or a Ray pipeline) is decided in runtime.py: serve/ and bench/
    import nothing of workers/ (bench's testbed runs are testbed/'s)."""
    graph = import_graph()
    bad = sorted(f"{a} imports {b}" for a, targets in graph.items() for b in targets
                 if a.startswith(("ggml_dist.serve", "ggml_dist.bench")) and b.startswith("ggml_dist.workers"))
    assert not bad, "\n".join(bad)


def test_imports_only_go_down():
    graph = import_graph()
    assert set(RANK) >= {layer(m) for m in graph} - {""}, "a package missing from LAYERS"
    upward = sorted(f"{a} imports {b}" for a, targets in graph.items() for b in targets
                    if layer(a) and layer(b) and layer(a) != layer(b) and RANK[layer(b)] >= RANK[layer(a)])
    assert not upward, "\n".join(upward)


# backends/: base.py (the device protocol) and collective.py (what ALL_GATHER exchanges through) below cpu/
# (the CPU backend) below accel.py (a fake GPU made of the CPU's kernels) below devices.py (the device kinds,
# which open each). Inside cpu/, the numpy reference path imports no numba; the compiled twins do.
BACKENDS_ORDER = ("backends.base", "backends.collective", "backends.cpu", "backends.host", "backends.accel",
                  "backends.devices")
REFERENCE = ("base", "cpu/quants", "cpu/blocks", "cpu/ops", "cpu/reference", "cpu/backend", "cpu/rope",
             "cpu/numerics", "cpu/fusion", "cpu/recurrent", "cpu/unary", "host", "collective", "cpu/gather")


def _numba_imports(path: Path) -> list[int]:
    tree = ast.parse(path.read_text())
    return [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom)
            and any((getattr(n, "module", None) or a.name).split(".")[0] in ("numba", "llvmlite")
                    for a in n.names)]


def test_backends_import_only_down_inside_the_layer():
    def part(mod: str) -> int | None:
        return next((i for i, p in enumerate(BACKENDS_ORDER) if mod == f"ggml_dist.{p}"
                     or mod.startswith(f"ggml_dist.{p}.")), None)

    upward = sorted(f"{a} imports {b}" for a, targets in import_graph().items() for b in targets
                    if (i := part(a)) is not None and (j := part(b)) is not None and j > i)
    assert not upward, "\n".join(upward)


def test_the_reference_kernels_do_not_import_numba():
    """quants.py (block formats, the numpy MUL_MAT), blocks.py (their table) and the op
    kernels are the reference the compiled twins are checked against; numba is imported only by the
    modules that compile."""
    for name in REFERENCE:
        found = _numba_imports(PACKAGE / "backends" / f"{name}.py")
        assert not found, f"backends/{name}.py imports numba at line(s) {found}"


def test_every_backends_module_is_either_reference_or_compiled():
    """A new module of backends/ is put on one side or the other: on the reference side (REFERENCE)
    it must not import numba; a module that imports numba is a compiled one."""
    known = set(REFERENCE) | {"__init__", "accel", "devices", "cpu/__init__"}
    for path in sorted((PACKAGE / "backends").rglob("*.py")):
        name = path.relative_to(PACKAGE / "backends").with_suffix("").as_posix()
        what = f"backends/{name}.py: reference (add it to REFERENCE) or compiled (it imports no numba)?"
        assert name in known or _numba_imports(path), what
