"""fastdora.poetx stands alone: it imports torch and the standard library, never transformers or peft, and of
fastdora only the shared base modules (config, compat, stats, _launch, the cached Triton launcher, _native, the C++
extension's build and launch programs, and _backward_window, callbacks around a forward's backward), none of the
DoRA implementation. Its Triton kernels
(kernels*.py, the only modules that may import triton) live inside it."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

POETX = Path(__file__).resolve().parents[2] / "core" / "poetx"
ALLOWED_PARENT = {"config", "compat", "stats", "_launch", "_native", "_backward_window"}


def _imports(path: Path):
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield 0, alias.name
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield node.level, node.module
        elif isinstance(node, ast.ImportFrom):  # from .. import a, b: the modules a and b of that package
            for alias in node.names:
                yield node.level, alias.name


def test_poetx_imports_only_torch_the_standard_library_and_its_own_modules():
    files = sorted(POETX.glob("*.py"))
    assert {f.stem for f in files} >= {"__init__", "cayley", "ops", "layer", "convert"}
    bad = []
    for path in files:
        for level, module in _imports(path):
            top = module.split(".")[0]
            if level == 1:
                ok = True  # fastdora.poetx's own modules
            elif level == 2:
                ok = top in ALLOWED_PARENT
            elif level == 0 and top == "fastdora":
                parts = module.split(".")
                ok = len(parts) > 1 and (parts[1] == "poetx" or parts[1] in ALLOWED_PARENT)
            elif level == 0 and top == "triton":
                ok = path.stem.startswith("kernels")
            else:
                ok = level == 0 and (top in ("torch", "__future__") or top in sys.stdlib_module_names)
            if not ok:
                bad.append(f"{path.name}: {'.' * level}{module}")
    assert not bad, bad
