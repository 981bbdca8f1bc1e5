"""Honest defaults: the shipped thresholds fail the demo pair (a round-to-nearest W4A8 copy of a 135 M model),
rightly, and the demo's committed tasks/demo-thresholds.toml passes it; the demo writes where git ignores.

Judged on the committed example's metrics (reports/smollm2-135m-w4a8/results.json) through the very
`build_tasks` a run uses, so this costs no model; the SmolLM2 tier shows the same with `evalsuite run`
(tests/e2e/test_smollm2.py)."""

from __future__ import annotations

import inspect
import json
import subprocess
from pathlib import Path

import pytest

from evalsuite.cli.app import (
    DEMO_CKPT,
    DEMO_OUT,
    DEMO_THRESHOLDS,
    VISION_DEMO_OUT,
    demo_command,
    read_thresholds,
)
from evalsuite.contract.spec import default_spec_path
from evalsuite.pipeline.runner import build_tasks
from evalsuite.protocol.task import RunContext

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "reports" / "smollm2-135m-w4a8" / "results.json"
JUDGED = ["ppl", "intref", "lmeval"]


def verdicts(thresholds: dict) -> dict[str, bool]:
    """Whether each task's checks pass on the committed example's metrics under these thresholds."""
    metrics = {name: entry["metrics"] for name, entry in json.loads(EXAMPLE.read_text())["tasks"].items()}
    tasks = build_tasks(JUDGED, RunContext(), thresholds)
    judged = {}
    for task in tasks:
        checks, _ = task.spec.threshold_checks(metrics[task.name])
        assert checks, task.name
        judged[task.name] = all(c.passed for c in checks)
    return judged


def test_the_shipped_defaults_fail_the_demo_pair_and_the_demo_thresholds_pass_it():
    assert verdicts({}) == {"ppl": False, "intref": False, "lmeval": False}
    demo = read_thresholds(default_spec_path(DEMO_THRESHOLDS))
    assert set(demo) == set(JUDGED)
    assert verdicts(demo) == {"ppl": True, "intref": True, "lmeval": True}


def test_the_demo_writes_into_a_git_ignored_folder_and_the_committed_example_is_tracked():
    if subprocess.run(["git", "rev-parse"], cwd=REPO, capture_output=True).returncode != 0:
        pytest.skip("not a git checkout")
    assert inspect.signature(demo_command).parameters["out"].default == DEMO_OUT / DEMO_CKPT
    for written in (DEMO_OUT / DEMO_CKPT / "results.json", VISION_DEMO_OUT / "report.md"):
        ignored = subprocess.run(["git", "check-ignore", "-q", str(written)], cwd=REPO)
        assert ignored.returncode == 0, f"{written} is not git-ignored"
    tracked = subprocess.run(
        ["git", "ls-files", "--error-unmatch", str(EXAMPLE)], cwd=REPO, capture_output=True
    )
    assert tracked.returncode == 0, tracked.stderr
