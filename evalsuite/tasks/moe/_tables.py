"""The `moe` task's tables: a pack's calibration coverage read and checked (`read_coverage`), and every
routed expert's figures as the report's rows (`ExpertTable`)."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from evalsuite.errors import InputError

COVERAGE_SCHEMA = "evalsuite.calibration-coverage/1"
COVERAGE_KEY = re.compile(r"^(\d+)\.(\d+)$")


def read_coverage(path: Path, layers: Collection[int], n_experts: int) -> dict[tuple[int, int], float]:
    """A pack's calibration coverage: `{"schema": COVERAGE_SCHEMA, "tokens": {"L.E": count}}`, where L is a
    decoder layer holding routed experts, E an expert index below the layer's expert count and count the
    (possibly weighted, so fractional) number of calibration tokens routed to that expert; an expert not
    listed had none. Anything else is refused, naming the file."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(f"calibration coverage is not readable JSON: {exc}", path) from None
    if (
        not isinstance(doc, dict)
        or doc.get("schema") != COVERAGE_SCHEMA
        or not isinstance(doc.get("tokens"), dict)
    ):
        raise InputError(
            f'calibration coverage must be {{"schema": "{COVERAGE_SCHEMA}", '
            '"tokens": {"LAYER.EXPERT": count}}',
            path,
        )
    coverage: dict[tuple[int, int], float] = {}
    for key, value in doc["tokens"].items():
        match = COVERAGE_KEY.match(key)
        if match is None:
            raise InputError(f'calibration coverage key {key!r} is not LAYER.EXPERT (e.g. "3.17")', path)
        layer, expert = int(match[1]), int(match[2])
        if layer not in layers or expert >= n_experts:
            raise InputError(
                f"calibration coverage names expert {key}, which the model lacks ({len(layers)} decoder "
                f"layers, {n_experts} routed experts each)",
                path,
            )
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
            or value < 0
        ):
            raise InputError(f"calibration coverage of {key} is {value!r}, not a count >= 0", path)
        coverage[(layer, expert)] = float(value)
    return coverage


def expert_name(layer: int, expert: int) -> str:
    return f"layer {layer} expert {expert}"


@dataclass
class ExpertTable:
    """Every routed expert's figures, (MoE layer, expert) arrays, as the report's rows: one expert's row, the
    totals of each layer, and every expert's row for moe_experts.csv."""

    moe_layers: list[int]
    usage: np.ndarray
    measured_rows: np.ndarray  # the expert's outputs compared (tokens of the fed windows routed to it)
    enough: np.ndarray  # whether those are at least the spec's min_expert_tokens: its error is judged
    rel_err: np.ndarray
    cosine: np.ndarray
    hot: np.ndarray
    hurt: np.ndarray
    calibration: np.ndarray | None  # calibration tokens, None when the candidate ships no coverage

    def row(self, s: int, e: int, below: np.ndarray) -> dict[str, Any]:
        """Expert `e` of MoE layer slot `s`: its tokens, share of its layer's, measured tokens, error (None
        where none was measured), whether that error is judged (enough measured tokens), hot and hurt."""
        measured = bool(self.measured_rows[s, e] > 0)
        row: dict[str, Any] = {
            "expert": expert_name(self.moe_layers[s], e),
            "tokens": int(self.usage[s, e]),
            "usage_share": float(self.usage[s, e] / self.usage[s].sum()),
            "measured_tokens": int(self.measured_rows[s, e]),
            "rel_err": float(self.rel_err[s, e]) if measured else None,
            "cosine": float(self.cosine[s, e]) if measured else None,
            "judged": bool(self.enough[s, e]),
            "hot": bool(self.hot[s, e]),
            "hurt": bool(self.hurt[s, e]),
        }
        if self.calibration is not None:
            row["calibration_tokens"] = float(self.calibration[s, e])
            row["below_floor"] = bool(below[s, e])
        return row

    def per_layer(self, below: np.ndarray | None) -> list[dict[str, Any]]:
        """One row per MoE layer: how many of its experts are used, measured, measured on enough tokens to be
        judged, hot, hurt, both (and below the calibration floor), and the median and 90th percentile of its
        judged experts' errors."""
        rows = []
        for s, layer in enumerate(self.moe_layers):
            used = self.usage[s] > 0
            measured = self.measured_rows[s] > 0
            errors = self.rel_err[s][self.enough[s]]
            row: dict[str, Any] = {
                "table": "experts per MoE layer (hot: at least the uniform share of tokens; hurt: error "
                "above hurt_rel_err_floor)",
                "layer": layer,
                "used": int(used.sum()),
                "measured": int(measured.sum()),
                "judged": int(self.enough[s].sum()),
                "hot": int(self.hot[s].sum()),
                "hurt": int(self.hurt[s].sum()),
                "hot_and_hurt": int((self.hot[s] & self.hurt[s]).sum()),
                "median_rel_err": float(np.median(errors)) if errors.size else None,
                "p90_rel_err": float(np.quantile(errors, 0.9)) if errors.size else None,
            }
            if below is not None:
                row["below_calibration_floor"] = int(below[s].sum())
            rows.append(row)
        return rows

    def every_row(self, below: np.ndarray) -> list[dict[str, Any]]:
        """Every expert's row, layer by layer, its layer and index in columns of their own (the CSV)."""
        rows = []
        for s, layer in enumerate(self.moe_layers):
            for e in range(self.usage.shape[1]):
                row = self.row(s, e, below)
                rows.append({"layer": layer, **row, "expert": e})
        return rows
