"""No unused exports: every name a module of the package lists in `__all__` is imported from it by another
module, a test, a benchmark or a script, and every public name a module defines is used somewhere. A name
nothing uses is a promise no one holds the code to; the package's face (`evalsuite/__init__.py`, what a user
imports) is exempt: that is what it is for."""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

ROOT = Path(__file__).parents[2]
PACKAGE = ROOT / "evalsuite"
USERS = ("evalsuite", "tests", "bench", "scripts")
FACE = PACKAGE / "__init__.py"


def module_name(path: Path) -> str:
    """`evalsuite/tasks/moe/__init__.py` → `evalsuite.tasks.moe`."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def sources() -> dict[Path, str]:
    """Every Python file that may use the package's names, and the project file (its entry points)."""
    found = {path: path.read_text(encoding="utf-8") for root in USERS for path in (ROOT / root).rglob("*.py")}
    return {**found, ROOT / "pyproject.toml": (ROOT / "pyproject.toml").read_text(encoding="utf-8")}


@cache
def trees() -> dict[Path, ast.Module]:
    """Every Python file of `sources`, parsed."""
    return {path: ast.parse(text) for path, text in sources().items() if path.suffix == ".py"}


@cache
def imported_from() -> dict[str, dict[str, set[Path]]]:
    """module → name → the files that import the name from the module (`from module import name`)."""
    found: dict[str, dict[str, set[Path]]] = {}
    for path, tree in trees().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    found.setdefault(node.module, {}).setdefault(alias.name, set()).add(path)
    return found


def exported(tree: ast.Module) -> list[str]:
    """The names of a module's `__all__` (empty where it has none)."""
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return [ast.literal_eval(element) for element in node.value.elts]  # type: ignore[attr-defined]
    return []


def defined(tree: ast.Module) -> list[str]:
    """The public names a module defines at its top, less the functions and classes a decorator registers
    (a CLI command, a task): the decorator is their use."""
    names = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.ClassDef) and not node.decorator_list:
            names.append(node.name)
        elif isinstance(node, ast.Assign):
            names += [t.id for t in node.targets if isinstance(t, ast.Name)]
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.append(node.target.id)
    return [n for n in names if not n.startswith("_")]


def modules() -> list[tuple[Path, ast.Module]]:
    """The package's modules, parsed, less its face."""
    return sorted((p, tree) for p, tree in trees().items() if p.is_relative_to(PACKAGE) and p != FACE)


def test_every_name_a_module_exports_is_imported_from_it_elsewhere():
    unused = []
    for path, tree in modules():
        module = module_name(path)
        for name in exported(tree):
            importers = imported_from().get(module, {}).get(name, set()) - {path}
            # `module.name` once the module itself is imported, or `module:name` (an entry point).
            spelled = re.compile(rf"\b{re.escape(module.rsplit('.', 1)[-1])}[.:]{re.escape(name)}\b")
            if not importers and not any(spelled.search(t) for p, t in sources().items() if p != path):
                unused.append(f"{module}: {name}")
    assert unused == [], "listed in __all__, imported from the module by nothing:\n" + "\n".join(unused)


def test_every_public_name_a_module_defines_is_used():
    counts: dict[str, int] = {}
    for text in sources().values():
        for word in re.findall(r"\b[A-Za-z_]\w*\b", text):
            counts[word] = counts.get(word, 0) + 1
    unused = []
    for path, tree in modules():
        for name in defined(tree):
            # Its definition is one occurrence; any other, here or elsewhere, is a use.
            if counts.get(name, 0) <= 1:
                unused.append(f"{module_name(path)}: {name}")
    assert unused == [], "defined and used nowhere:\n" + "\n".join(unused)
