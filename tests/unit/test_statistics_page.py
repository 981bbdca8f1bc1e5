"""docs/statistics.md names, for every sentence the reports print, the test that checks it: each named test
exists, so that the page cannot point at a test that was renamed or removed."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NAMED = re.compile(r"`(tests/[\w/]+\.py)::(test_\w+)`")


def missing_tests(page: str) -> list[str]:
    """The `tests/…py::test_…` a page names that no such file defines."""
    missing = []
    for path, name in NAMED.findall(page):
        file = ROOT / path
        tree = ast.parse(file.read_text(encoding="utf-8")) if file.is_file() else ast.Module([], [])
        if name not in {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}:
            missing.append(f"{path}::{name}")
    return missing


def test_every_test_the_statistics_page_names_exists():
    page = (ROOT / "docs" / "statistics.md").read_text(encoding="utf-8")
    assert len(NAMED.findall(page)) >= 30
    assert missing_tests(page) == []


def test_a_page_naming_a_test_that_does_not_exist_is_caught():
    page = "`tests/unit/test_claims.py::test_that_was_never_written` and `tests/unit/gone.py::test_x`"
    assert missing_tests(page) == [
        "tests/unit/test_claims.py::test_that_was_never_written",
        "tests/unit/gone.py::test_x",
    ]
