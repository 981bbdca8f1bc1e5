"""The Python API on the tiny MiniCPM-V 4.7 pair: `evalsuite.run` and `evalsuite.compare` called from Python
return typed results equal to the results.json and compare.json they wrote; the progress callback sees every
pass; a set cancel event stops a run with `Cancelled`, and the same call resumes it."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import jsonschema
import pytest

import evalsuite
from evalsuite.fixtures import TINY_BF16, TINY_W4A8

TASKS = ["ppl", "tensors"]


def written(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def api_run(tiny_pair, tmp_path_factory):
    passes: list[tuple[str, int]] = []
    steps = [0]

    def progress(description: str, total: int):
        passes.append((description, total))

        def advance() -> None:
            steps[0] += 1

        return advance

    out = tmp_path_factory.mktemp("api") / "run"
    outcome = evalsuite.run(
        tiny_pair[TINY_W4A8],
        tiny_pair[TINY_BF16],
        tasks=TASKS,
        out=out,
        corpus="python-docs",
        model_card=True,
        progress=progress,
    )
    return outcome, passes, steps[0]


def test_run_returns_the_typed_results_it_wrote(api_run):
    outcome, _, _ = api_run
    assert isinstance(outcome.results, evalsuite.Results)
    assert outcome.paths["results"] == outcome.folder / "results.json"
    assert {"results", "report", "model_card"} <= set(outcome.paths)
    assert all(path.is_file() for path in outcome.paths.values())
    doc = written(outcome.paths["results"])
    jsonschema.validate(doc, evalsuite.json_schema("results"))
    assert outcome.results == evalsuite.load_results(outcome.paths["results"])
    assert outcome.document == doc
    assert doc["schema_version"] == evalsuite.SCHEMA_VERSION == outcome.results.schema_version
    assert outcome.verdict == doc["verdict"] and outcome.exit_code == {"pass": 0, "fail": 1}.get(
        doc["verdict"], 2
    )
    assert set(outcome.results.tasks) == set(TASKS)
    for name, entry in outcome.results.tasks.items():
        assert entry.status == doc["tasks"][name]["status"]
        assert entry.metrics == doc["tasks"][name]["metrics"]
        assert [c.model_dump(exclude_none=True) for c in entry.checks] == [
            {k: v for k, v in c.items() if v is not None} for c in doc["tasks"][name]["checks"]
        ]
    # the ppl ratio's window-clustered error travels with it
    assert "ln_ppl_ratio_stderr_window" in outcome.results.tasks["ppl"].metrics


def test_the_progress_callback_sees_every_pass(api_run):
    _, passes, steps = api_run
    assert passes and all(total >= 0 for _, total in passes)
    assert steps >= 1


def test_compare_returns_the_typed_comparison_it_wrote(tiny_pair, tmp_path):
    out = tmp_path / "cmp"
    outcome = evalsuite.compare(
        [tiny_pair[TINY_W4A8]],
        tiny_pair[TINY_BF16],
        out,
        tasks=["ppl"],
        corpus="python-docs",
        noise_floor=False,
    )
    assert isinstance(outcome.comparison, evalsuite.Comparison)
    assert outcome.comparison == evalsuite.load_comparison(out / "compare.json")
    doc = written(out / "compare.json")
    jsonschema.validate(doc, evalsuite.json_schema("compare"))
    assert doc["schema_version"] == evalsuite.SCHEMA_VERSION
    name = tiny_pair[TINY_W4A8].name
    assert [row.name for row in outcome.comparison.candidates] == [name]
    assert outcome.candidates[name] == evalsuite.load_results(out / name / "results.json")
    assert outcome.comparison.candidates[0].verdict == outcome.candidates[name].verdict
    assert (
        outcome.comparison.candidates[0].kld_mean == outcome.candidates[name].tasks["ppl"].metrics["kld_mean"]
    )


def test_a_set_cancel_event_stops_the_run_and_the_same_call_resumes(tiny_pair, tmp_path):
    cancel = threading.Event()

    def progress(description: str, total: int):
        def advance() -> None:
            cancel.set()  # after the first step of the first pass

        return advance

    arguments = dict(tasks=["ppl"], out=tmp_path / "run", corpus="python-docs")
    with pytest.raises(evalsuite.Cancelled, match="cancelled"):
        evalsuite.run(
            tiny_pair[TINY_W4A8], tiny_pair[TINY_BF16], progress=progress, cancel=cancel, **arguments
        )
    assert not (tmp_path / "run" / "results.json").exists()
    outcome = evalsuite.run(tiny_pair[TINY_W4A8], tiny_pair[TINY_BF16], cancel=threading.Event(), **arguments)
    assert outcome.results.tasks["ppl"].status in ("pass", "fail")


def test_bad_input_is_the_project_s_own_error_naming_the_file(tiny_pair, tmp_path):
    with pytest.raises(evalsuite.InputError, match="thresholds file does not exist"):
        evalsuite.run(
            tiny_pair[TINY_W4A8],
            tiny_pair[TINY_BF16],
            out=tmp_path / "r",
            thresholds=tmp_path / "missing.toml",
        )
