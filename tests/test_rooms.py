"""The order of the rooms (docs/design.md §2), checked on every import of the source.

A room is one folder of the code (or the foundation: the modules at the top of ``eagleflow/``); the
design's table puts each room on a floor, bottom to top. An import may only go down: to a room on a
lower floor. Two rooms on one floor never import each other, and no set of rooms imports itself
round in a loop. Every import counts, at any depth of a file (lazy ones inside functions too, and
``TYPE_CHECKING`` ones: a type names what a module is built on); a name a package re-exports lazily
(:func:`eagleflow.lazy_exports`) counts as an import of the module that defines it. What a family's
entry in the drafter registry names (``"module:attribute"``) is a plug-in, reached through the table
(:mod:`eagleflow.drafters.registry`), not an import; its owners are resolved by
``test_every_owner_the_registry_names_imports_from_its_familys_folder``.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DESIGN = REPO / "docs/design.md"
PACKAGES = ("eagleflow", "sglang_patch", "operators", "plugins", "dags")


@dataclass(frozen=True)
class Room:
    floor: int
    name: str
    where: str  # "eagleflow/engine/" (a folder and below), "eagleflow/*.py" (files directly in it), or a file


def declared_rooms(text: str) -> list[Room]:
    """The rooms of docs/design.md §2's table ``| floor | room | where | holds |``, bottom to top."""
    section = text.split("\n## 2. ", 1)[1].split("\n## 3. ", 1)[0]
    rooms = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and cells[0].isdigit():
            rooms += [Room(int(cells[0]), cells[1], where) for where in re.findall(r"`([^`]+)`", cells[2])]
    return rooms


ROOMS = declared_rooms(DESIGN.read_text(encoding="utf-8"))


def room_of(path: str, rooms: list[Room] = ROOMS) -> Room | None:
    """The room of the file ``path`` (relative to the repository): its most specific match in the table."""
    best: Room | None = None
    for room in rooms:
        if room.where.endswith("/*.py"):
            matches = path.startswith(room.where[:-4]) and "/" not in path[len(room.where) - 4:]
        elif room.where.endswith("/"):
            matches = path.startswith(room.where)
        else:
            matches = path == room.where
        if matches and (best is None or len(room.where.rstrip("*.py")) > len(best.where.rstrip("*.py"))):
            best = room
    return best


def module_files() -> dict[str, Path]:
    """Every module of the product by dotted name (a package by its ``__init__``)."""
    found = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def lazy_exports_of(path: Path) -> dict[str, str]:
    """name -> defining module of a package ``__init__`` that calls ``lazy_exports(__name__, {module: [names]})``."""
    names: dict[str, str] = {}
    package = ".".join(path.relative_to(REPO).parent.parts)
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "lazy_exports" and isinstance(node.args[1], ast.Dict):
            for key, value in zip(node.args[1].keys, node.args[1].values):
                for name in value.elts:  # type: ignore[attr-defined]
                    names[name.value] = f"{package}.{key.value}"  # type: ignore[union-attr]
    return names


def imports_of(modules: dict[str, Path]) -> dict[str, list[tuple[str, int]]]:
    """module -> [(imported module, line)], lazily re-exported names resolved to the module defining them."""
    lazy = {name: lazy_exports_of(path) for name, path in modules.items() if path.name == "__init__.py"}

    def targets(module: str, names: list[str]) -> list[str]:
        out = []
        for name in names or [""]:
            if f"{module}.{name}" in modules:
                out.append(f"{module}.{name}")
            elif name in lazy.get(module, {}):
                out.append(lazy[module][name])
            else:
                out.append(module)
        return out

    found: dict[str, list[tuple[str, int]]] = {}
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        edges = []
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                edges += [(alias.name, node.lineno) for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                edges += [(target, node.lineno) for target in targets(base, [a.name for a in node.names])]
        found[module] = [(target, line) for target, line in edges if target in modules]
    return found


def room_imports() -> list[tuple[Room, Room, str]]:
    """Every import from one room into another: (importer's room, imported room, "file:line imports module")."""
    modules = module_files()
    rel = {name: str(path.relative_to(REPO)) for name, path in modules.items()}
    out = []
    for module, edges in imports_of(modules).items():
        for target, line in edges:
            here, there = room_of(rel[module]), room_of(rel[target])
            if here is not None and there is not None and here != there:
                out.append((here, there, f"{rel[module]}:{line} imports {target}"))
    return out


def loops(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected sets of more than one room (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            members = []
            while True:
                member = stack.pop()
                members.append(member)
                if member == node:
                    break
            if len(members) > 1:
                found.append(sorted(members))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def test_the_design_declares_rooms_bottom_to_top() -> None:
    assert ROOMS, "docs/design.md §2 has no table of rooms"
    assert [r.floor for r in ROOMS] == sorted(r.floor for r in ROOMS)


def test_every_module_has_a_room() -> None:
    rootless = [str(p.relative_to(REPO)) for p in module_files().values() if room_of(str(p.relative_to(REPO))) is None]
    assert rootless == []


def test_no_import_loop_between_rooms() -> None:
    graph: dict[str, set[str]] = defaultdict(set)
    why: dict[tuple[str, str], str] = {}
    for here, there, where in room_imports():
        graph[here.where].add(there.where)
        why.setdefault((here.where, there.where), where)
    found = [
        " -> ".join(loop) + ": " + "; ".join(why[(a, b)] for a in loop for b in loop if (a, b) in why)
        for loop in loops(graph)
    ]
    assert found == []


def test_every_import_goes_down_the_order() -> None:
    """An import from a room to one on its own floor or above is against the order: it names the line."""
    against = sorted(
        f"{where} (floor {here.floor} {here.name} -> floor {there.floor} {there.name})"
        for here, there, where in room_imports()
        if there.floor >= here.floor
    )
    assert against == []


def test_the_check_finds_an_upward_import_and_a_loop() -> None:
    """The check itself, on a made-up pair of rooms: an upward import is found, and so is the loop it closes."""
    rooms = [Room(1, "low", "low/"), Room(2, "high", "high/")]
    assert room_of("high/x.py", rooms) == rooms[1] and room_of("low/a/b.py", rooms) == rooms[0]
    assert loops({"low/": {"high/"}, "high/": {"low/"}}) == [["high/", "low/"]]
    assert loops({"high/": {"low/"}}) == []


@pytest.mark.parametrize("family", sorted({"eagle3", "dflash", "dspark"}))
def test_no_file_named_after_a_family_lives_outside_its_folder(family: str) -> None:
    named = [
        str(path.relative_to(REPO))
        for package in PACKAGES
        for path in (REPO / package).rglob("*")
        if family in path.name and "__pycache__" not in path.parts
        and not path.relative_to(REPO).as_posix().startswith("eagleflow/drafters/")
    ]
    assert named == []


def test_every_owner_the_registry_names_imports_from_its_familys_folder() -> None:
    """Each family's owners (train flags, export, checkpoint layout, serving flags, reference decoder) resolve,
    and live in ``eagleflow/drafters/<folder>/``: a new family is one folder and one registry entry."""
    from eagleflow.drafters import FAMILIES, STAGES

    for family in FAMILIES.values():
        folders = set()
        for stage in (*STAGES, *(["calibration"] if family.calibration else [])):
            module = getattr(family, stage).partition(":")[0]
            assert family.owner(stage) is not None, f"{family.name} {stage}"
            assert module.startswith("eagleflow.drafters."), f"{family.name} {stage}: {module}"
            folders.add(module.split(".")[2])
        assert len(folders) == 1, f"{family.name}: owners in {sorted(folders)}"
