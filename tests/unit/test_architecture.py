"""The package's import graph: one-way floors, as ARCHITECTURE.md draws them, and no circle anywhere.

The graph is read from the source with `ast`, counting every import: at module level, inside functions
(lazy imports) and under `TYPE_CHECKING` (type-only imports), since each of them is a floor leaning on
another.
"""

from __future__ import annotations

import ast
import fnmatch
import functools
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "evalsuite"


def module_name(path: Path, package: Path = PACKAGE) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_modules(package: Path = PACKAGE) -> dict[str, Path]:
    return {module_name(p, package): p for p in sorted(package.rglob("*.py"))}


def imports_of(name: str, path: Path, modules: set[str]) -> set[str]:
    """The evalsuite modules a module imports, explicitly (a package's own `__init__` runs first when one
    of its modules is imported, but that is Python's doing, not an edge of the design)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_package else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            # `from evalsuite.x import y`: an edge to evalsuite.x.y if that is a module, else to evalsuite.x.
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    modules = package_modules(root)
    return {name: imports_of(name, path, set(modules)) for name, path in modules.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def floors() -> list[tuple[int, str, list[str]]]:
    """ARCHITECTURE.md's table of floors: (floor, name, module patterns), top floor first."""
    text = (ROOT / "ARCHITECTURE.md").read_text(encoding="utf-8")
    rows = []
    for line in text.splitlines():
        match = re.match(r"^\|\s*(\d+)\s*\|\s*([^|]+?)\s*\|([^|]+)\|", line)
        if match:
            patterns = re.findall(r"`([\w.*]+)`", match.group(3))
            rows.append((int(match.group(1)), match.group(2), patterns))
    return rows


def floor_of(module: str, table: list[tuple[int, str, list[str]]]) -> int | None:
    for floor, _, patterns in table:
        if any(fnmatch.fnmatchcase(module, p) for p in patterns):
            return floor
    return None


def test_the_import_graph_has_no_circle():
    assert circles(import_graph()) == []


def test_a_circle_is_found_where_there_is_one(tmp_path):
    package = tmp_path / "evalsuite"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("def f():\n    from evalsuite.sub import b\n")
    (package / "sub" / "__init__.py").write_text("")
    (package / "sub" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..a import f\n"
    )
    assert circles(import_graph(package)) == [["evalsuite.a", "evalsuite.sub.b"]]


def test_every_module_sits_on_a_floor_of_architecture_md():
    table = floors()
    assert table, "ARCHITECTURE.md has no table of floors"
    unplaced = [m for m in package_modules() if floor_of(m, table) is None]
    assert unplaced == [], f"modules missing from ARCHITECTURE.md's floors: {unplaced}"


@functools.cache
def package_graph() -> dict[str, set[str]]:
    """The package's graph, parsed once for the tests that each look at one module of it."""
    return import_graph()


@pytest.mark.parametrize("module", sorted(package_modules()))
def test_imports_go_to_the_same_floor_or_below(module):
    table = floors()
    graph = package_graph()
    mine = floor_of(module, table)
    upward = [t for t in sorted(graph[module]) if (floor_of(t, table) or 0) > (mine or 0)]
    assert upward == [], f"{module} (floor {mine}) imports from higher floors: {upward}"


def test_no_module_imports_the_package_face():
    """The face (`evalsuite/__init__.py`) re-exports the API from the top floor; a module that imported it
    (`from evalsuite import __version__`) would close a circle through the API, so none does."""
    leaning = sorted(m for m, targets in package_graph().items() if "evalsuite" in targets)
    assert leaning == [], f"these modules import the package face; import the submodule instead: {leaning}"


def test_no_submodule_bears_a_name_the_face_exports():
    """Importing `evalsuite.NAME` binds the module to the package's attribute NAME, replacing whatever the
    face put there: a module `evalsuite/compare.py` would turn `evalsuite.compare` from the function into
    the module as soon as anything imported it."""
    exported = set(re.findall(r'^    "(\w+)",$', (PACKAGE / "__init__.py").read_text(encoding="utf-8"), re.M))
    assert {"run", "compare", "record", "report"} <= exported
    children = {m.split(".")[1] for m in package_modules() if m.count(".") >= 1}
    assert sorted(exported & children) == []


def test_the_face_stands_alone_on_the_top_floor():
    table = floors()
    top = max(floor for floor, _, _ in table)
    assert floor_of("evalsuite", table) == top
    assert [m for m in package_modules() if floor_of(m, table) == top] == ["evalsuite"]


# Modules still over the limit, each with the work that splits it; the list only shrinks.
STILL_LONG: dict[str, str] = {}


def test_no_module_is_over_600_lines():
    long = {
        module: n
        for module, path in package_modules().items()
        if (n := len(path.read_text(encoding="utf-8").splitlines())) > 600 and module not in STILL_LONG
    }
    assert long == {}, f"modules over 600 lines (split where the split says something): {long}"
    short_again = [m for m in STILL_LONG if len(package_modules()[m].read_text().splitlines()) <= 600]
    assert short_again == [], f"no longer over 600 lines: strike them from STILL_LONG: {short_again}"


def test_a_module_its_package_imports_names_its_siblings_by_their_own_modules():
    """`from evalsuite.fixtures import exl3` inside a module that `fixtures/__init__.py` itself imports runs
    that half-built `__init__` to find a sibling: name the sibling's module (`from evalsuite.fixtures.exl3
    import …`) instead."""
    modules = package_modules()
    found = []
    for name, path in modules.items():
        package = name.rpartition(".")[0]
        init = modules.get(package)
        if not package or init is None or name not in imports_of(package, init, set(modules)):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and not node.level and node.module == package:
                found.append(f"{name}: from {package} import {', '.join(a.name for a in node.names)}")
    assert found == []


# ----------------------------------------------------------------------------------------------------------
# The wings: the package's folders, each a concern (ARCHITECTURE.md's table of wings)
# ----------------------------------------------------------------------------------------------------------


def wing_of(module: str) -> str:
    """The wing a module lives in: its package just below `evalsuite` (`evalsuite.stats.metrics` →
    `evalsuite.stats`); a module at the top of the package (`evalsuite.api`) stands for itself."""
    return ".".join(module.split(".")[:2])


def wing_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The import graph read at the level of wings: an edge from one wing to another wherever one of its
    modules imports one of the other's."""
    wings: dict[str, set[str]] = {}
    for module, targets in graph.items():
        wing = wing_of(module)
        wings.setdefault(wing, set()).update(w for w in map(wing_of, targets) if w != wing)
    return wings


def wings(package: Path = PACKAGE) -> list[Path]:
    return sorted(p for p in package.iterdir() if p.is_dir() and (p / "__init__.py").is_file())


def test_the_wings_stand_on_each_other_one_way():
    assert circles(wing_graph(import_graph())) == []


def test_an_upward_import_between_wings_is_found(tmp_path):
    """A scratch package of two wings, `high` on `low`: one upward import in `low`, lazy even, and the wings
    import each other, though no module imports its way back to itself."""
    package = tmp_path / "evalsuite"
    for wing in ("low", "high"):
        (package / wing).mkdir(parents=True)
        (package / wing / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "low" / "base.py").write_text("X = 1\n")
    (package / "high" / "top.py").write_text("from evalsuite.low.base import X\n")
    assert circles(wing_graph(import_graph(package))) == []
    (package / "low" / "helper.py").write_text("def f():\n    from evalsuite.high import top\n")
    assert circles(import_graph(package)) == []  # no module circle: only the wings lean on each other
    assert circles(wing_graph(import_graph(package))) == [["evalsuite.high", "evalsuite.low"]]


def test_each_wing_sits_on_one_floor_or_adjacent_ones():
    table = floors()
    spread = {}
    for wing in wings():
        name = module_name(wing / "__init__.py")
        found = {floor_of(m, table) for m in package_modules() if wing_of(m) == name}
        spread[name] = sorted(f for f in found if f is not None)
    wide = {w: f for w, f in spread.items() if f and f[-1] - f[0] > 1}
    assert wide == {}, f"wings spanning floors that are not adjacent: {wide}"


def test_every_wing_says_what_lives_there():
    silent = [w.name for w in wings() if not ast.get_docstring(ast.parse((w / "__init__.py").read_text()))]
    assert silent == []


def test_the_top_of_the_package_holds_few_entries_besides_its_wings():
    """The face, the API, errors, the version, the machine and their data: at most 12 entries beside the
    wing folders, so that the package's top shows its wings, not an alphabetical list of modules."""
    entries = [p.name for p in PACKAGE.iterdir() if p.name != "__pycache__" and p not in wings()]
    assert len(entries) <= 12, sorted(entries)
