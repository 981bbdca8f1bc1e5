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
from typing import Literal, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from evalsuite.errors import InputError


class StrictModel(BaseModel):
    """Base of every spec section: unknown keys are errors, so a typo never passes silently."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class Threshold(StrictModel):
    """A bound on one metric: `min`, `max` or both (inclusive)."""

    min: float | None = None
    max: float | None = None

    @model_validator(mode="after")
    def _has_a_bound(self) -> Threshold:
        if self.min is None and self.max is None:
            raise ValueError("a threshold needs `min` or `max`")
        if self.min is not None and self.max is not None and self.min > self.max:
            raise ValueError(f"min {self.min} is above max {self.max}")
        return self


class Check(StrictModel):
    """One comparison of a metric with its threshold, as results.json records it."""

    name: str
    value: float | bool | None
    op: Literal[">=", "<=", "=="]
    threshold: float | bool
    passed: bool


def apply_threshold(name: str, value: float | None, threshold: Threshold) -> list[Check]:
    """The checks a threshold makes on a value; a missing or NaN value never passes."""
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
            )
        )
    return checks


class TaskSpec(StrictModel):
    """Fields every task spec has."""

    description: str = ""
    thresholds: dict[str, Threshold] = {}

    @property
    def sha256(self) -> str:
        """Identity of the validated spec (not of its file's formatting)."""
        canonical = json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()


S = TypeVar("S", bound=TaskSpec)


def default_spec_path(task_name: str) -> Path:
    """Where the spec shipped with evalsuite lives: the repo's `tasks/` or the wheel's copy of it."""
    packaged = resources.files("evalsuite").joinpath("_task_specs", f"{task_name}.toml")
    if packaged.is_file():
        return Path(str(packaged))
    return Path(__file__).resolve().parent.parent / "tasks" / f"{task_name}.toml"


def _line_of(text: str, key: str) -> int | None:
    """First line where `key` is assigned or opens a table, for error messages."""
    pattern = re.compile(rf"^\s*(\[+\s*)?([\w.]*\.)?{re.escape(key)}\s*[=\].]", re.MULTILINE)
    match = pattern.search(text)
    return None if match is None else text.count("\n", 0, match.start()) + 1


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
        keys = [str(p) for p in err["loc"] if not isinstance(p, int)]
        line = next((n for k in reversed(keys) if (n := _line_of(text, k)) is not None), None)
        where = f" (line {line})" if line is not None else ""
        raise InputError(f"field `{loc}`{where}: {err['msg']}", path) from None
