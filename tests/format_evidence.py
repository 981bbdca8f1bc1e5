"""The evidence behind docs/formats.md's table: which test shows what of which checkpoint format, and how
it ended in the last run that recorded it.

A test says what it shows with the marker `format_evidence(format=…, claim=…, writer=…)`; the keyword
arguments of every such marker on a test (function, parametrization, module) merge, the closest winning,
so a module can name its format and writer once and a parameter can name the claim. `claim` is one of
`CLAIMS`, or a list of them. `pytest --format-evidence FILE` writes every marked test's outcome to FILE
(JSON, atomically) when the session ends; `scripts/render_formats.py` runs that and renders the table.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import tempfile
from datetime import UTC, datetime
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import pytest

MARKER = "format_evidence"
SCHEMA = "evalsuite.format-evidence/1"
# The table's columns, in order: what a format's tests must show (issue 46's must-show, per format).
CLAIMS = {
    "tensors": "`tensors` passes the pack",
    "decode": "decode equals the format's own dequantization",
    "code": "a corrupted code fails, by name",
    "scale": "a corrupted scale fails, by name",
    "ppl": "`ppl` runs",
    "refused": "unloadable files refused before any load",
}
# Each marked test's record by node id, in the process that writes the file (the xdist controller).
_RECORDS: dict[str, dict[str, Any]] = {}
# What a render of the evidence rewrites: a run with only these changed is a run of HEAD.
RENDERED_EXCLUDES = (":!docs/format-evidence.json", ":!docs/formats.md")
VERSIONED = ("torch", "transformers", "compressed-tensors", "safetensors", "gguf", "mlx")


def evidence_of(item: pytest.Item) -> dict[str, Any] | None:
    """The merged `format_evidence` keywords of a test, or None when it carries none."""
    markers = list(item.iter_markers(MARKER))
    if not markers:
        return None
    merged: dict[str, str] = {}
    for marker in reversed(markers):  # farthest first, so the closest marker's keywords win
        merged.update(marker.kwargs)
    claims = merged.get("claim")
    if claims is None:
        return None  # a module's marker names the format for the tests that make a claim
    claims = [claims] if isinstance(claims, str) else list(claims)
    if "format" not in merged or not claims or not set(claims) <= CLAIMS.keys():
        raise pytest.UsageError(f"{item.nodeid}: {MARKER} needs a format and claims of {list(CLAIMS)}")
    return {**merged, "claim": claims}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--format-evidence",
        metavar="FILE",
        default=None,
        help="run only the tests marked with a format_evidence claim; write their outcomes to FILE",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", f"{MARKER}(format, claim, writer): what a test shows of a format (docs/formats.md)"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # user_properties travel with each report from an xdist worker to the session that writes the file.
    kept, dropped = [], []
    for item in items:
        found = evidence_of(item)
        if found is not None:
            item.user_properties.append((MARKER, found))
        (kept if found is not None else dropped).append(item)
    if config.getoption("--format-evidence") and dropped:  # a run for the evidence runs only the evidence
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    found = dict(report.user_properties).get(MARKER)
    if found is None:
        return
    record = _RECORDS.setdefault(report.nodeid, {"test": report.nodeid, **found, "outcome": "passed"})
    if report.failed:
        record["outcome"] = "failed"
    elif report.skipped and record["outcome"] == "passed":
        record["outcome"] = "skipped"


def pytest_sessionfinish(session: pytest.Session) -> None:
    config = session.config
    target = config.getoption("--format-evidence")
    if target is None or hasattr(config, "workerinput"):
        return
    records = sorted(_RECORDS.values(), key=lambda r: r["test"])
    document = {
        "schema": SCHEMA,
        "date": datetime.now(UTC).strftime("%Y-%m-%d"),
        "commit": _commit(),
        "python": platform.python_version(),
        "versions": {name: _version(name) for name in VERSIONED},
        "tests": records,
    }
    path = Path(target)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as out:
        json.dump(document, out, indent=1, ensure_ascii=False)
        out.write("\n")
    os.replace(out.name, path)


def _version(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def _commit() -> str | None:
    """HEAD, marked when tracked files differ from it (other than the two files the evidence renders)."""

    def git(*args: str) -> str:
        done = subprocess.run(
            ["git", *args], capture_output=True, text=True, check=False, cwd=Path(__file__).parent
        )
        return done.stdout.strip()

    head = git("rev-parse", "--short", "HEAD")
    changed = git("status", "--porcelain", "--untracked-files=no", "--", ".", *RENDERED_EXCLUDES).splitlines()
    return (f"{head} with uncommitted changes" if changed else head) or None
