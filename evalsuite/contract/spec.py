"""Task specs: the declarative half of a task, read from `tasks/<name>.toml` and validated at start-up.

A spec is a pydantic model; a bad spec fails before any model is loaded, naming the file, the field and,
where the TOML text shows it, the line.
"""

from __future__ import annotations

import hashlib
import json
import re
import tomllib
from importlib import resources
from pathlib import Path
from typing import Any, ClassVar, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator, model_validator

from evalsuite.errors import InputError
from evalsuite.stats import claims


class StrictModel(BaseModel):
    """Base of every spec section: unknown keys are errors, so a typo never passes silently."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class Threshold(StrictModel):
    """A bound on one metric: `min`, `max` or both (inclusive), judged on the metric's estimate or on one of
    its one-sided 95% confidence bounds (`on`).

    With `max`, `on = "upper95"` passes only what is shown to stay under it (a release gate) and
    `on = "lower95"` fails only what is shown to exceed it (a nightly gate that must not flap on noise); with
    `min`, the other way round. The bound is the task's `NAME_upper95` / `NAME_lower95` where it reports one,
    else NAME ± t · NAME_stderr_window with `n_windows` − 1 degrees of freedom (`evalsuite.stats.claims`); a
    metric without one, or from too few windows, has no bound, and its check does not pass.
    """

    min: float | None = None
    max: float | None = None
    on: Literal["estimate", "upper95", "lower95"] = "estimate"

    @model_validator(mode="after")
    def _has_a_bound(self) -> Threshold:
        if self.min is None and self.max is None:
            raise ValueError("a threshold needs `min` or `max`")
        if self.min is not None and self.max is not None and self.min > self.max:
            raise ValueError(f"min {self.min} is above max {self.max}")
        return self


class Check(StrictModel):
    """One comparison of a metric with its threshold, as results.json records it. `on` says what `value` is
    when it is a confidence bound of the metric rather than its estimate (`upper95`, `lower95`)."""

    name: str
    value: float | bool | None
    op: Literal[">=", "<=", "=="]
    threshold: float | bool
    passed: bool
    on: Literal["upper95", "lower95"] | None = None


def flat_metric_tables(table: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Metric tables with dotted names flattened: TOML reads `a.acc.recovery = { min = 0.9 }` as nested
    tables, and this gives `{"a.acc.recovery": {"min": 0.9}}`. A table whose values are all tables is a name
    prefix; any other value is a bound (a threshold or a tolerance), validated as such."""
    flat: dict[str, Any] = {}
    for key, value in table.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value and all(isinstance(v, dict) for v in value.values()):
            flat.update(flat_metric_tables(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def apply_threshold(
    name: str, value: float | None, threshold: Threshold, values: dict[str, Any] | None = None
) -> list[Check]:
    """The checks a threshold makes on a value (or, with `on`, on the bound of it that `values` gives or
    lets compute: `Threshold`); a missing or NaN value never passes."""
    on = None
    if threshold.on != "estimate":
        on = threshold.on
        value = metric_bound(name, value, on, values or {})
    checks = []
    ok = value is not None and value == value  # NaN != NaN
    if threshold.min is not None:
        checks.append(
            Check(
                name=name,
                value=value,
                op=">=",
                threshold=threshold.min,
                passed=bool(ok and value >= threshold.min),
                on=on,
            )
        )
    if threshold.max is not None:
        checks.append(
            Check(
                name=name,
                value=value,
                op="<=",
                threshold=threshold.max,
                passed=bool(ok and value <= threshold.max),
                on=on,
            )
        )
    return checks


def metric_bound(
    name: str, value: float | None, on: Literal["upper95", "lower95"], values: dict[str, Any]
) -> float | None:
    """A metric's one-sided 95% bound: the task's own `NAME_upper95` / `NAME_lower95`, else from its
    window-clustered standard error and window count; None where neither exists."""
    given = values.get(f"{name}_{on}")
    if isinstance(given, int | float) and not isinstance(given, bool):
        return float(given)
    stderr, clusters = values.get(f"{name}_stderr_window"), values.get("n_windows")
    if value is None or not isinstance(stderr, int | float) or not isinstance(clusters, int):
        return None
    return claims.bound(float(value), float(stderr), clusters, on)


class Tolerance(StrictModel):
    """How far a metric may worsen against an accepted baseline run before it is a regression.

    The allowance is the larger of `abs` and `rel` × |baseline value|; `worse` says which direction is worse.
    """

    worse: Literal["higher", "lower"]
    abs: float = 0.0
    rel: float = 0.0

    def check(self, name: str, value: float | None, baseline: float) -> Check:
        """The regression check of `value` against `baseline`; a missing or NaN value never passes."""
        allowance = max(self.abs, self.rel * abs(baseline))
        ok = value is not None and value == value
        if self.worse == "higher":
            bound = baseline + allowance
            return Check(
                name=f"{name}_vs_baseline",
                value=value,
                op="<=",
                threshold=bound,
                passed=bool(ok and value <= bound),
            )
        bound = baseline - allowance
        return Check(
            name=f"{name}_vs_baseline",
            value=value,
            op=">=",
            threshold=bound,
            passed=bool(ok and value >= bound),
        )


class TaskSpec(StrictModel):
    """Fields every task spec has.

    `thresholds` and `regression` are used only when comparing; changing them never invalidates a saved
    observation or a recording. A task's own `compare` section, if it has one, is compare-only too.
    """

    description: str = ""
    thresholds: dict[str, Threshold] = {}
    regression: dict[str, Tolerance] = {}

    COMPARE_ONLY: ClassVar[frozenset[str]] = frozenset({"description", "thresholds", "regression", "compare"})

    @field_validator("thresholds", "regression", mode="before")
    @classmethod
    def _dotted_names(cls, value: Any) -> Any:
        return flat_metric_tables(value) if isinstance(value, dict) else value

    def threshold_checks(
        self, values: dict[str, Any], measurable: frozenset[str] | None = None
    ) -> tuple[list[Check], list[str]]:
        """The checks of every threshold of the spec on a task's metric values, and the thresholded metrics
        that were not measured.

        A metric outside `measurable` (the metrics this run could measure; None: all) whose value is absent
        or None was not measured, e.g. the bit-exact decode of a format that has no reference decoder: it is
        listed, never passed. Any other missing or NaN value is a failed check.
        """
        checks: list[Check] = []
        not_measured: list[str] = []
        for name, threshold in self.thresholds.items():
            value = values.get(name)
            if value is None and measurable is not None and name not in measurable:
                not_measured.append(name)
                continue
            checks += apply_threshold(name, value, threshold, values)
        return checks, not_measured

    @property
    def sha256(self) -> str:
        """Identity of the validated spec (not of its file's formatting)."""
        return _canonical_sha256(self.model_dump(mode="json"))

    @property
    def measured_sha256(self) -> str:
        """Identity of what the task's metrics measure under this spec: everything but the description, the
        thresholds and the regression tolerances, which judge a metric and never change it. A baseline's
        metric is compared with a run's only under the same identity
        (`evalsuite.contract.results.not_comparable`)."""
        exclude = {"description", "thresholds", "regression"}
        return _canonical_sha256(self.model_dump(mode="json", exclude=exclude))

    @property
    def observation_sha256(self) -> str:
        """Identity of what the spec asks an observation to be: everything but the compare-only fields."""
        return _canonical_sha256(self.model_dump(mode="json", exclude=set(self.COMPARE_ONLY)))


def _canonical_sha256(doc: Any) -> str:
    canonical = json.dumps(doc, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


S = TypeVar("S", bound=TaskSpec)


def default_spec_path(task_name: str) -> Path:
    """Where the spec shipped with evalsuite lives: the repo's `tasks/` or the wheel's copy of it."""
    packaged = resources.files("evalsuite").joinpath("_task_specs", f"{task_name}.toml")
    if packaged.is_file():
        return Path(str(packaged))
    return Path(str(resources.files("evalsuite"))).resolve().parent / "tasks" / f"{task_name}.toml"


def _line_of(text: str, loc: tuple[Any, ...]) -> int | None:
    """The line of the TOML text that a validation error's location points at, or None.

    Follows the location as far as the text shows it: a table or key assignment for each name, and for an
    index into an array of tables (`[[prompts]]`), that entry's header. A missing field points at the table
    that lacks it.
    """
    lines = text.splitlines()
    start, end, found = 0, len(lines), None
    path: list[str] = []
    for i, part in enumerate(loc):
        if isinstance(part, int):
            if not path:
                return found
            header = re.compile(rf"^\s*\[\[\s*{re.escape('.'.join(path))}\s*\]\]")
            entries = [n for n in range(start, end) if header.match(lines[n])]
            if part >= len(entries):
                return found
            start = entries[part]
            following = [n for n in range(start + 1, end) if lines[n].lstrip().startswith("[")]
            end = following[0] if following else end
            found = start + 1
            path = []
            continue
        path.append(str(part))
        key = re.compile(rf"^\s*(\[+\s*)?([\w.]*\.)?{re.escape(str(part))}\s*[=\].]")
        hit = next((n for n in range(start, end) if key.match(lines[n])), None)
        if hit is not None:
            found = hit + 1
            if i + 1 < len(loc) and not isinstance(loc[i + 1], int):
                start = hit
        elif found is not None and i == len(loc) - 1:
            return found
    return found


def load_spec(model: type[S], path: Path, overrides: dict | None = None) -> S:
    """Read and validate a spec file; `overrides` (same shape) are merged on top, e.g. `--thresholds`."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InputError("spec file does not exist", path) from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise InputError(f"invalid TOML: {exc}", path) from None
    for section, values in (overrides or {}).items():
        if isinstance(values, dict) and isinstance(data.get(section), dict):
            data[section] = {**data[section], **values}
        else:
            data[section] = values
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(part) for part in err["loc"])
        line = _line_of(text, tuple(err["loc"]))
        where = f" (line {line})" if line is not None else ""
        raise InputError(f"field `{loc}`{where}: {err['msg']}", path) from None
