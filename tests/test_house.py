"""The house rules, checked on the source.

The house is drawn by its imports. A *room* is a module of the core (``zeroimpl/*.py``, named by its stem) or one
of the two packages above it, ``checkpoint/`` and ``integrations/``, each counted as ONE room (imports between
a package's own modules stay inside its room). ``zeroimpl/__init__.py`` is the front door, no room: an import of
``zeroimpl`` counts as an import of the core modules that define the names it takes. Every import counts,
those under ``if TYPE_CHECKING:`` and inside functions included (an annotation that names a higher room is a
dependency on it all the same). A room's *floor* is 1 + the longest chain of imports below it (a room that
imports no other is on floor 1).

Rules: no import circles; the core on at most 8 floors, the whole of ``zeroimpl/`` on at most 10;
docs/design.md's layers table gives every room and the floor its imports put it on (so a module imports only
rooms on lower floors); no core file (checkpoint/ included) over 800 lines -- a module holds one job, readable in
one sitting, not a cap met by cutting jobs in half; the core imports torch alone.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "zeroimpl"
PACKAGES = ("checkpoint", "integrations")
MAX_LINES = 800
MAX_CORE_FLOORS = 8
MAX_FLOORS = 10


def _layers() -> dict[str, int]:
    """Room -> floor, from the rows of design.md's layers table (``| 3 | `a.py` / `b.py` | ... |``; a package
    row names it as ``checkpoint/``)."""
    layers, text = {}, (ROOT / "docs" / "design.md").read_text()
    for layer, modules in re.findall(r"^\| (\d+)[^|]* \| ([^|]+) \|", text, flags=re.MULTILINE):
        for name in re.findall(r"`(\w+)(?:\.py|/)`", modules):
            layers[name] = int(layer)
    return layers


def _core_modules() -> list[Path]:
    return sorted(p for p in CORE.glob("*.py") if p.name != "__init__.py")


def _room_of(module: str) -> str | None:
    """The room of a dotted module name under ``zeroimpl`` (``zeroimpl.checkpoint.api`` -> ``checkpoint``)."""
    parts = module.split(".")
    if parts[0] != "zeroimpl" or len(parts) < 2:
        return None
    return parts[1] if parts[1] in PACKAGES or (CORE / f"{parts[1]}.py").exists() else None


@functools.lru_cache(maxsize=None)
def _front_door() -> dict[str, str]:
    """Name -> the core room that defines it, for the names ``zeroimpl/__init__.py`` re-exports."""
    names = {}
    for node in ast.walk(ast.parse((CORE / "__init__.py").read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
            names |= {alias.name: _room_of(f"zeroimpl.{node.module}") for alias in node.names}
    return names


def _imported_rooms(path: Path) -> set[str]:
    """The rooms ``path`` imports: every import, ``TYPE_CHECKING`` and function-level ones included."""
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])  # the package this file is in
    rooms = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            rooms |= {_room_of(alias.name) for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            if base == "zeroimpl":  # the front door, or a room imported by name (``from . import layout``)
                rooms |= {_front_door().get(alias.name) or _room_of(f"zeroimpl.{alias.name}") for alias in node.names}
            else:
                rooms.add(_room_of(base))
    return rooms - {None}


@functools.lru_cache(maxsize=None)
def import_graph() -> dict[str, frozenset[str]]:
    """Room -> the other rooms it imports."""
    files = {p.stem: [p] for p in _core_modules()}
    files |= {package: sorted((CORE / package).rglob("*.py")) for package in PACKAGES}
    return {room: frozenset(set().union(*map(_imported_rooms, paths)) - {room}) for room, paths in files.items()}


def _reachable(room: str) -> set[str]:
    """The rooms ``room`` imports, directly or through others."""
    graph, seen, todo = import_graph(), set(), [room]
    while todo:
        for below in graph[todo.pop()] - seen:
            seen.add(below)
            todo.append(below)
    return seen


def import_circles() -> list[list[str]]:
    """The rooms caught in import circles, one list per circle (rooms that import each other, directly or not)."""
    reach = {room: _reachable(room) for room in import_graph()}
    circles = {frozenset(other for other in reach[room] if room in reach[other]) for room in reach if room in reach[room]}
    return sorted(sorted(circle) for circle in circles)


def floors() -> dict[str, int]:
    """Room -> 1 + the longest chain of imports below it (an edge closing a circle is left out)."""
    graph, floor = import_graph(), {}

    def climb(room: str, path: frozenset) -> int:
        if room not in floor:
            below = [climb(other, path | {room}) for other in graph[room] if other not in path | {room}]
            floor[room] = 1 + max(below, default=0)
        return floor[room]

    for room in sorted(graph):
        climb(room, frozenset())
    return floor


def test_the_layers_table_names_every_room():
    missing = [room for room in import_graph() if room not in _layers()]
    assert not missing, f"docs/design.md's layers table does not name {missing}"


def test_no_import_circles():
    assert not import_circles(), import_circles()


def test_modules_import_only_rooms_on_lower_floors_of_the_table():
    layers = _layers()
    upward = [f"{room} (floor {layers[room]}) imports {name} (floor {layers[name]})"
              for room, names in import_graph().items() for name in names
              if room in layers and name in layers and layers[name] >= layers[room]]
    assert not upward, upward


def test_the_layers_table_gives_each_room_the_floor_its_imports_put_it_on():
    layers, computed = _layers(), floors()
    wrong = {room: f"table {layers.get(room)}, imports {floor}" for room, floor in computed.items()
             if layers.get(room) != floor}
    assert not wrong, f"docs/design.md's layers table disagrees with the import graph: {wrong}"


def test_the_core_stands_on_at_most_8_floors():
    core = {room: floor for room, floor in floors().items() if room not in PACKAGES}
    assert max(core.values()) <= MAX_CORE_FLOORS, sorted(core.items(), key=lambda item: -item[1])


def test_the_house_stands_on_at_most_10_floors():
    computed = floors()
    assert max(computed.values()) <= MAX_FLOORS, sorted(computed.items(), key=lambda item: -item[1])


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


def _methods_that_issue_collectives(path: Path, class_name: str) -> dict[str, list[str]]:
    """For each method of ``class_name`` in ``path``: the collectives of zeroimpl.comm it names (``comm.<name>``)."""
    tree = ast.parse(path.read_text())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == class_name]
    found = {}
    for method in (n for n in cls.body if isinstance(n, ast.FunctionDef)):
        names = [n.attr for n in ast.walk(method) if isinstance(n, ast.Attribute)
                 and isinstance(n.value, ast.Name) and n.value.id == "comm" and n.attr != "issues_collectives"]
        if names:
            found[method.name] = names
    return found


def test_the_gradient_reducers_collectives_go_through_its_one_issue():
    """GradientReducer issues a collective only as a launch handed to ``_issue`` (which holds it to ``_own_work``,
    a span of the work stream and one InFlight): every method that names one of comm's collectives hands it
    there, and nothing else builds an InFlight. So a collective added elsewhere -- to ``end_step``, say --
    cannot skip the FAILED handling and the stream ordering silently."""
    path = CORE / "grad_sync.py"
    source = path.read_text()
    for method, names in _methods_that_issue_collectives(path, "GradientReducer").items():
        body = ast.get_source_segment(source, next(
            n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef) and n.name == method))
        assert "self._issue(" in body and all(f"functools.partial(comm.{name}" in body for name in names), (
            method, names)
    assert source.count("InFlight(") == 1 + source.count("class InFlight(")  # (the class, and _issue's one)
