"""The house rules, checked on the source: docs/design.md's layers table names every core module, a module
imports only modules of its own layer or below (no callback structure can then run upward through an import),
no core file is over 400 lines, and the core imports torch alone."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "zeroimpl"
MAX_LINES = 400


def _layers() -> dict[str, int]:
    """Module name -> layer, from the rows of design.md's layers table (``| 1 | `a.py` / `b.py` | ... |``; a
    row whose layer cell is ``above`` names packages above the core)."""
    layers, text = {}, (ROOT / "docs" / "design.md").read_text()
    for layer, modules in re.findall(r"^\| (\d)[^|]* \| ([^|]+) \|", text, flags=re.MULTILINE):
        for name in re.findall(r"`(\w+)\.py`", modules):
            layers[name] = int(layer)
    return layers


def _core_modules() -> list[Path]:
    return sorted(p for p in CORE.glob("*.py") if p.name != "__init__.py")


def _runtime_imports(path: Path) -> set[str]:
    """The core modules ``path`` imports at run time (imports under ``if TYPE_CHECKING:`` are for annotations)."""
    tree = ast.parse(path.read_text())
    names = set()
    for node in tree.body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        for inner in ast.walk(node):
            if isinstance(inner, ast.ImportFrom) and inner.level == 1:
                names |= {inner.module.split(".")[0]} if inner.module else {a.name for a in inner.names}
    return names


def test_the_layers_table_names_every_core_module():
    missing = [p.stem for p in _core_modules() if p.stem not in _layers()]
    assert not missing, f"docs/design.md's layers table does not name {missing}"


def test_modules_import_only_their_own_layer_or_below():
    layers = _layers()
    upward = [f"{p.stem} (layer {layers[p.stem]}) imports {name} (layer {layers[name]})"
              for p in _core_modules() for name in _runtime_imports(p)
              if name in layers and layers[name] > layers[p.stem]]
    assert not upward, upward


def test_no_core_file_is_over_the_limit():
    long = {p.name: n for p in CORE.rglob("*.py") if "integrations" not in p.parts
            and (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"core files over {MAX_LINES} lines: {long}"


def test_the_core_imports_torch_alone():
    third_party = set()
    for path in CORE.rglob("*.py"):
        if "integrations" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                third_party |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                third_party.add(node.module.split(".")[0])
    import sys
    assert third_party - set(sys.stdlib_module_names) == {"torch"}


def test_tests_share_helpers_through_helper_modules_not_other_tests():
    """A test module imports helpers from workloads.py, distributed.py or layout_checks.py, never from another
    test module (whose fixtures and module-level launches would come along)."""
    offenders = []
    for path in sorted((ROOT / "tests").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("test_"):
                offenders.append(f"{path.name} imports {node.module}")
    assert not offenders, offenders
