"""What evalsuite writes for other programs, as typed models: results.json, compare.json and a recording's
manifest.json, with the JSON Schema generated from them and a reader that refuses what it cannot read.

The models are the contract (DESIGN.md, "Contract: results.json"); `schema_version` is MAJOR.MINOR. A minor
version only adds optional fields, so every model accepts fields it does not know (a reader of 1.1 reads a
1.3 file); a major version removes, renames or changes the meaning of a field, and a reader refuses a major
it does not know rather than misread it (docs/stability.md). A file written before `schema_version` existed
is 1.0.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from evalsuite.errors import InputError

RESULTS_SCHEMA = "evalsuite.results/1"
COMPARE_SCHEMA = "evalsuite.compare/1"
RECORDING_SCHEMA = "evalsuite.recording/2"
# 1.1 added `schema_version` itself; 1.0 is every file written before it. 1.2 added each task's `identity`
# (what its metrics measured), `not_comparable` and `differences`, and compare.json's `kld_floor_margin`.
SCHEMA_VERSION = "1.2"
SUPPORTED_MAJOR = 1

Verdict = Literal["pass", "fail", "error"]
Status = Literal["pass", "fail", "error", "skipped"]
MetricValue = float | int | bool | str | None


class Document(BaseModel):
    """A part of a document evalsuite writes: unknown fields are kept (a later minor version adds some)."""

    model_config = ConfigDict(extra="allow")


class CheckRecord(Document):
    """One check of a metric against its threshold: a non-finite value or threshold is null."""

    name: str
    value: float | bool | None
    op: Literal[">=", "<=", "=="]
    threshold: float | bool | None
    passed: bool
    on: Literal["upper95", "lower95"] | None = None


class SampleRecord(Document):
    """What some of a task's metrics were measured on."""

    windows: list[int] | None = Field(None, description="The protocol's windows, by index.")
    tokens: int | None = Field(None, description="Tokens measured (per MoE layer, for `moe`).")
    words: str | None = Field(None, description="The sample as a report says it.")


class IdentityRecord(Document):
    """What a task's metrics measured: a baseline's metric is compared with a run's only where both are the
    same (`not_comparable`). A metric's identity is the spec's digest and its sample: `metric_samples`'s
    entry for it, else the sample named `every`."""

    spec_sha256: str | None = Field(
        None, description="sha256 of the task's spec less its description, thresholds and tolerances."
    )
    samples: dict[str, SampleRecord] = {}
    metric_samples: dict[str, str] = {}


class DifferenceRecord(Document):
    """A paired difference from the reference a task tested; reports name those significant after Holm."""

    name: str
    said: str
    test: str
    p: float | None
    p_holm: float | None = Field(None, description="p adjusted by Holm over every difference of the run.")
    worse: bool
    metrics: list[str] = []


class TaskRecord(Document):
    """One task's entry: its outcome, metrics (null with a reason where not finite), checks and files."""

    status: Status
    reason: str | None = Field(None, description="Why the task is `error` or `skipped`.")
    metrics: dict[str, MetricValue] = {}
    null_reasons: dict[str, str] = {}
    checks: list[CheckRecord] = []
    not_measured: list[str] = []
    descriptions: dict[str, str] = {}
    spec: dict[str, Any] = {}
    identity: IdentityRecord | None = None
    not_comparable: dict[str, str] = Field(
        {}, description="Regression tolerances not applied: the baseline measured the metric otherwise."
    )
    differences: list[DifferenceRecord] = Field(
        [], description="Paired tests of the candidate against the reference, significant or not."
    )
    artifacts: dict[str, str] = Field({}, description="Files the task wrote, relative to the run folder.")
    details: list[dict[str, Any]] = []


class SideRecord(Document):
    """One side as the run saw it: a checkpoint folder or a recording of one."""

    path: str
    format: str
    fingerprint: str
    content_sha256: str | None = None
    recorded_from: dict[str, Any] | None = None
    environment: dict[str, Any] | None = None


class EnvironmentRecord(Document):
    """Package versions and the execution settings of the run."""

    python: str
    platform: str
    packages: dict[str, str | None]
    device: str
    device_name: str
    dtype: str
    torch_threads: int | None = None
    machine: dict[str, Any] | None = None


class Results(Document):
    """results.json: one candidate against its reference."""

    schema_: Literal["evalsuite.results/1"] = Field(RESULTS_SCHEMA, alias="schema")
    schema_version: str = Field("1.0", pattern=r"^\d+\.\d+$")
    ckpt: SideRecord
    ref: SideRecord
    environment: EnvironmentRecord
    verdict: Verdict
    tasks: dict[str, TaskRecord]
    model_loads: list[dict[str, Any]] = []
    baseline: str | None = None
    replay: dict[str, Any] | None = None

    model_config = ConfigDict(extra="allow", populate_by_name=True)


class CandidateRow(Document):
    """One candidate's row of compare.json."""

    name: str
    path: str | None
    format: str | None
    verdict: Verdict
    bits_per_weight: float | None
    bits_per_weight_from: str
    bytes: int | None
    ppl_ratio: float | None = None
    ppl_ratio_stderr: float | None = None
    kld_mean: float | None = None
    kld_mean_stderr: float | None = None
    kld_median: float | None = None
    kld_p99: float | None = None
    same_top_p: float | None = None
    top5_agreement: float | None = None
    delta_p_mean: float | None = None
    rms_delta_p: float | None = None
    kld_floor_ratio: float | None = None
    noise_floor: str | None = Field(None, description="How the candidate stands against the noise floor.")
    pareto: bool = False
    downstream: dict[str, MetricValue] = {}


class Comparison(Document):
    """compare.json: many candidates against one reference."""

    schema_: Literal["evalsuite.compare/1"] = Field(COMPARE_SCHEMA, alias="schema")
    schema_version: str = Field("1.0", pattern=r"^\d+\.\d+$")
    ref: str
    kld_floor: float | None = None
    kld_floor_draws: int | None = None
    kld_floor_draw_spread: float | None = None
    kld_floor_margin: float | None = Field(
        None, description="`within` the floor: a mean KLD shown to be at most (1 + this) × the floor's."
    )
    candidates: list[CandidateRow]
    pairs: list[dict[str, Any]] = []
    artifacts: dict[str, str] = {}

    model_config = ConfigDict(extra="allow", populate_by_name=True)


class RecordedObservationRecord(Document):
    """One recorded observation: what shaped it (identity, inputs), who needs it, where it was made."""

    identity: dict[str, Any]
    inputs: dict[str, Any]
    tasks: list[str]
    backend: str


class RecordingManifest(Document):
    """A recording's manifest.json (`reference_outputs/NAME/manifest.json`)."""

    schema_: Literal["evalsuite.recording/2"] = Field(RECORDING_SCHEMA, alias="schema")
    evalsuite: str
    checkpoint: dict[str, Any]
    tokenizer_sha256: str | None
    environment: dict[str, Any]
    observations: dict[str, RecordedObservationRecord]

    model_config = ConfigDict(extra="allow", populate_by_name=True)


DEFAULT_SAMPLE = "every"


def metric_identity(identity: dict[str, Any] | None, name: str) -> tuple[str | None, dict[str, Any] | None]:
    """A metric's identity in a task's results.json `identity`: the spec's digest and the metric's sample
    (None for either that is not recorded)."""
    identity = identity or {}
    sample = (identity.get("metric_samples") or {}).get(name, DEFAULT_SAMPLE)
    return identity.get("spec_sha256"), (identity.get("samples") or {}).get(sample)


def not_comparable(name: str, baseline: dict[str, Any] | None, run: dict[str, Any]) -> str | None:
    """Why a baseline's `name` is not the run's quantity (None when it is): the baseline records no identity
    (written before evalsuite recorded one), or measured it under another spec or on another sample.

    Args:
        name: the metric.
        baseline: the baseline task's `identity` (None where it has none).
        run: this run's task `identity`.
    """
    if not baseline or baseline.get("spec_sha256") is None:
        return "the baseline does not record what it measured (written before results.json kept an identity)"
    spec_before, sample_before = metric_identity(baseline, name)
    spec_now, sample_now = metric_identity(run, name)
    if _sample_key(sample_before) != _sample_key(sample_now):
        said = [_said(sample_before), _said(sample_now)]
        why = f"the baseline measured it {said[0]}, this run {said[1]}"
        return why + ("" if spec_before == spec_now else ", under another spec")
    if spec_before != spec_now:
        return (
            f"the baseline measured it under another spec (measured_sha256 {str(spec_before)[:12]}…, this "
            f"run's {str(spec_now)[:12]}…)"
        )
    return None


def _sample_key(sample: dict[str, Any] | None) -> tuple[Any, Any]:
    return (None, None) if sample is None else (sample.get("windows"), sample.get("tokens"))


def _said(sample: dict[str, Any] | None) -> str:
    if sample is None:
        return "on a sample it does not record"
    if sample.get("words"):
        return str(sample["words"])
    return f"on windows {sample.get('windows')} ({sample.get('tokens')} tokens)"


SCHEMAS: dict[str, type[Document]] = {
    "results": Results,
    "compare": Comparison,
    "recording": RecordingManifest,
}


def json_schema(kind: str = "results") -> dict[str, Any]:
    """The JSON Schema of one document, generated from its model.

    Args:
        kind: `results` (results.json), `compare` (compare.json) or `recording` (a recording's manifest).
    """
    schema = SCHEMAS[kind].model_json_schema(by_alias=True)
    schema["$id"] = f"https://evalsuite.invalid/schema/{kind}-{SCHEMA_VERSION}.json"
    return schema


def _read(path: Path) -> Any:
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InputError("results file does not exist", path) from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise InputError(f"invalid JSON: {str(exc).splitlines()[0]}", path) from None


def check_version(doc: Any, path: Path | str, schema: str) -> None:
    """Refuse, in one line naming the file, a document that is not `schema` or is of a major version this
    evalsuite does not read.

    Args:
        doc: the parsed JSON document.
        path: the file it was read from (named in the error).
        schema: the `schema` field it must carry (e.g. `evalsuite.results/1`).
    """
    if not isinstance(doc, dict) or doc.get("schema") != schema:
        raise InputError(f"not an evalsuite file of schema {schema}", path)
    version = doc.get("schema_version", "1.0")
    major = str(version).split(".")[0]
    if not major.isdigit() or int(major) != SUPPORTED_MAJOR:
        raise InputError(
            f"schema_version {version} is not supported (this evalsuite reads {SUPPORTED_MAJOR}.x); "
            "use the evalsuite version that wrote it",
            path,
        )


def _validated(model: type[Document], doc: dict[str, Any], path: Path | str) -> Any:
    try:
        return model.model_validate(doc)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "document"
        raise InputError(f"{where}: {first['msg']} ({exc.error_count()} error(s))", path) from None


def read_results(path: Path | str) -> dict[str, Any]:
    """A results.json document as plain JSON, its schema and version checked (the form the report renderers
    take).

    Args:
        path: the results.json file.
    """
    doc = _read(Path(path))
    check_version(doc, path, RESULTS_SCHEMA)
    if not isinstance(doc.get("tasks"), dict):
        raise InputError(f"not an evalsuite results file (schema {RESULTS_SCHEMA})", path)
    return doc


def load_results(path: Path | str) -> Results:
    """A results.json file as the typed `Results`; a file of an unknown major version is refused.

    Args:
        path: the results.json file (a run folder's, or any copy of one).

    Raises:
        InputError: the file is missing, not JSON, not a results file, of an unknown major version, or does
            not match the schema; the message is one line naming the file.
    """
    return _validated(Results, read_results(path), path)


def load_comparison(path: Path | str) -> Comparison:
    """A compare.json file as the typed `Comparison`; a file of an unknown major version is refused.

    Args:
        path: the compare.json file.

    Raises:
        InputError: as `load_results`.
    """
    doc = _read(Path(path))
    check_version(doc, path, COMPARE_SCHEMA)
    return _validated(Comparison, doc, path)


def load_recording_manifest(path: Path | str) -> RecordingManifest:
    """A recording's manifest.json as the typed `RecordingManifest`.

    Args:
        path: the manifest.json file of a recording folder.

    Raises:
        InputError: as `load_results`.
    """
    doc = _read(Path(path))
    if not isinstance(doc, dict) or doc.get("schema") != RECORDING_SCHEMA:
        raise InputError(f"not an evalsuite recording manifest (schema {RECORDING_SCHEMA})", path)
    return _validated(RecordingManifest, doc, path)
