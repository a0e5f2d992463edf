"""The package's layering, read from the source with ``ast`` (no import needed): no import cycles in core/, and each
layer imports only from the layers below it (docs/ARCHITECTURE.md)."""

from __future__ import annotations

import ast
from pathlib import Path

CORE = Path(__file__).resolve().parents[1] / "core"

# layer of each module (by dotted name relative to the package); a module may import only from its own layer or below
LAYERS = {
    "config": 0, "compat": 0, "stats": 0,
    "_launch": 0,  # the cached Triton launcher both kernel sets use; imports only compat and _native
    "_native": 0,  # the C++ extension's build and the Triton launcher ABI of its direct launches; imports only config
    "_backward_window": 0,  # callbacks around the backward of a forward's outputs (slots, POET-X's batched series)
    "cache": 1,
    "poetx": 1,  # POET-X: its own math and autograd; may use only config / compat / stats / the layer-0 helpers
    "kernels": 2,
    "ops": 3,
    "dispatch": 4,
    "distributed": 5, "layers": 5,
    "slots": 5,  # norm slots read by compiled graphs; imports layers (which must not import it)
    "patching": 6,
    "": 7,  # the package's __init__
}


def _modules() -> dict:
    out = {}
    for path in CORE.rglob("*.py"):
        rel = path.relative_to(CORE).with_suffix("")
        parts = list(rel.parts)
        is_pkg = parts[-1] == "__init__"
        if is_pkg:
            parts = parts[:-1]
        out[".".join(parts)] = (path, is_pkg)
    return out


def _imports(name: str, path: Path, is_pkg: bool, known: set) -> set:
    """Package-internal modules ``name`` imports (anywhere in the file, function bodies included)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    pkg = name.split(".") if is_pkg else name.split(".")[:-1]
    if name == "":
        pkg = []
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg[: len(pkg) - (node.level - 1)] if node.level > 1 else list(pkg)
                mod = ".".join(base + ([node.module] if node.module else []))
            elif node.module and node.module.split(".")[0] == "fastdora":
                mod = ".".join(node.module.split(".")[1:])
            else:
                continue
            subs = [f"{mod}.{a.name}" if mod else a.name for a in node.names]
            # `from pkg import submodule` depends on the submodule; `from pkg import name` on the package
            for sub in subs:
                if sub in known:
                    found.add(sub)
                elif mod in known:
                    found.add(mod)
        elif isinstance(node, ast.Import):
            for a in node.names:
                parts = a.name.split(".")
                if parts[0] == "fastdora" and ".".join(parts[1:]) in known:
                    found.add(".".join(parts[1:]))
    found.discard(name)
    return found


def _graph() -> dict:
    mods = _modules()
    known = set(mods)
    return {name: _imports(name, path, is_pkg, known) for name, (path, is_pkg) in mods.items()}


def _layer(name: str) -> int:
    return LAYERS[name.split(".")[0]]


def test_every_module_has_a_layer():
    missing = sorted(n for n in _graph() if n.split(".")[0] not in LAYERS)
    assert not missing, f"modules without a layer in this test (add them, and to docs/ARCHITECTURE.md): {missing}"


def test_core_has_no_import_cycle():
    graph = _graph()
    state: dict = {}
    stack: list = []

    def visit(n):
        state[n] = 1
        stack.append(n)
        for m in sorted(graph[n]):
            if state.get(m) == 1:
                cycle = stack[stack.index(m):] + [m]
                raise AssertionError("import cycle in core/: " + " -> ".join(c or "fastdora" for c in cycle))
            if m not in state:
                visit(m)
        stack.pop()
        state[n] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n)


def test_each_layer_imports_only_from_below():
    bad = []
    for name, deps in _graph().items():
        for dep in deps:
            if dep == "" or _layer(dep) > _layer(name):
                bad.append(f"{name or 'fastdora'} imports {dep or 'fastdora'}")
    assert not bad, "layering violations: " + "; ".join(sorted(bad))


def test_kernels_are_a_leaf():
    graph = _graph()
    for name, deps in graph.items():
        if name.split(".")[0] == "kernels":
            outside = sorted(d for d in deps if d.split(".")[0] not in ("kernels", "config", "compat", "_launch",
                                                                                 "_native"))
            assert not outside, f"{name} imports {outside}: kernels/ may use only config, compat, _launch, _native"


def test_poetx_is_independent_of_the_dora_modules():
    for name, deps in _graph().items():
        if name.split(".")[0] == "poetx":
            allowed = ("poetx", "config", "compat", "stats", "_launch", "_backward_window", "_native")
            outside = sorted(d for d in deps if d.split(".")[0] not in allowed)
            assert not outside, f"{name} imports {outside}"


def test_only_config_reads_the_environment():
    readers = []
    for path in CORE.rglob("*.py"):
        src = path.read_text()
        if ("os.environ" in src or "os.getenv" in src) and path.name != "config.py":
            readers.append(str(path.relative_to(CORE)))
    assert not readers, f"environment read outside config.py: {readers}"


def test_the_checker_finds_a_cycle(tmp_path):
    """The cycle check itself works: a two-module cycle written to a scratch package is found."""
    (tmp_path / "__init__.py").write_text("")
    (tmp_path / "config.py").write_text("from . import stats\n")
    (tmp_path / "stats.py").write_text("def f():\n    from .config import x\n")
    global CORE
    saved, CORE = CORE, tmp_path
    try:
        try:
            test_core_has_no_import_cycle()
        except AssertionError as e:
            assert "config -> stats -> config" in str(e)
        else:
            raise AssertionError("the cycle was not found")
    finally:
        CORE = saved
