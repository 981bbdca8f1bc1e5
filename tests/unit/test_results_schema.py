"""The results schema: every document evalsuite has committed validates against the JSON Schema generated from
the typed models (and against the models), the published schema is what the models generate, and a file of
an unknown major version is refused in one line that names it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

import evalsuite
from evalsuite.contract.results import (
    SCHEMA_VERSION,
    json_schema,
    load_comparison,
    load_recording_manifest,
    load_results,
    read_results,
)
from evalsuite.errors import InputError

ROOT = Path(__file__).resolve().parents[2]
COMMITTED_RESULTS = sorted(
    p for top in ("reports", "reference_outputs") for p in (ROOT / top).rglob("results.json")
)
COMMITTED_RECORDINGS = sorted((ROOT / "reference_outputs").glob("*/manifest.json"))
COMMITTED_COMPARISONS = sorted(
    p for top in ("reports", "reference_outputs") for p in (ROOT / top).rglob("compare.json")
)


def schema_validator(kind: str) -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator(json_schema(kind))


def test_there_are_committed_documents_to_check():
    assert COMMITTED_RESULTS and COMMITTED_RECORDINGS


@pytest.mark.parametrize("path", COMMITTED_RESULTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_committed_results_json_validates(path):
    doc = json.loads(path.read_text(encoding="utf-8"))
    schema_validator("results").validate(doc)
    typed = load_results(path)
    assert typed.verdict == doc["verdict"] and set(typed.tasks) == set(doc["tasks"])


@pytest.mark.parametrize("path", COMMITTED_RECORDINGS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_committed_recording_validates(path):
    schema_validator("recording").validate(json.loads(path.read_text(encoding="utf-8")))
    assert load_recording_manifest(path).observations


def test_every_committed_compare_json_validates():
    # None is committed today; tests/e2e/test_api.py validates the compare.json a comparison writes.
    for path in COMMITTED_COMPARISONS:
        schema_validator("compare").validate(json.loads(path.read_text(encoding="utf-8")))
        assert load_comparison(path).candidates


def test_the_published_schema_is_what_the_models_generate():
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "json_schema.py"), "--check"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 0, done.stdout + done.stderr


def with_version(tmp_path: Path, version: str | None) -> Path:
    doc = json.loads(COMMITTED_RESULTS[0].read_text(encoding="utf-8"))
    doc.pop("schema_version", None)
    if version is not None:
        doc["schema_version"] = version
    path = tmp_path / "results.json"
    path.write_text(json.dumps(doc), encoding="utf-8")
    return path


def test_a_results_file_of_schema_version_9_is_refused_in_one_line_naming_it(tmp_path):
    path = with_version(tmp_path, "9.0")
    with pytest.raises(InputError) as refused:
        evalsuite.load_results(path)
    message = str(refused.value)
    assert "\n" not in message and str(path) in message and "schema_version 9.0" in message
    with pytest.raises(InputError, match=r"schema_version 9\.0"):
        read_results(path)  # what `report` and `--baseline` read


def test_a_newer_minor_version_with_a_field_it_does_not_know_is_read(tmp_path):
    path = with_version(tmp_path, "1.7")
    doc = json.loads(path.read_text(encoding="utf-8"))
    doc["a_field_of_1_7"] = {"x": 1}
    path.write_text(json.dumps(doc), encoding="utf-8")
    assert load_results(path).schema_version == "1.7"


def test_a_file_without_schema_version_is_1_0(tmp_path):
    assert load_results(with_version(tmp_path, None)).schema_version == "1.0"
    assert SCHEMA_VERSION.split(".")[0] == "1"


def test_a_file_that_does_not_match_the_schema_is_refused_in_one_line(tmp_path):
    path = with_version(tmp_path, SCHEMA_VERSION)
    doc = json.loads(path.read_text(encoding="utf-8"))
    doc["verdict"] = "maybe"
    path.write_text(json.dumps(doc), encoding="utf-8")
    with pytest.raises(InputError) as refused:
        load_results(path)
    assert "\n" not in str(refused.value) and "verdict" in str(refused.value)


def test_evalsuite_report_refuses_a_results_file_of_schema_version_9_in_one_line(tmp_path):
    from conftest import assert_refused, cli_in_process

    path = with_version(tmp_path, "9.0")
    code, lines, _ = cli_in_process("report", tmp_path, "--format", "md")
    assert_refused(code, lines, str(path), "schema_version 9.0 is not supported")
    assert not (tmp_path / "report.md").exists()
