"""The calibration set against a task's evaluated texts: the `[calibration]` spec section, the overlap of
each window (or chat, smoke prompt, vision question) with the set given by `--calibration FILE` or named by
the candidate's metadata, and what a task reports of it. How the overlap is found is
`evalsuite.inputs.calibration_set`.

A task that scores texts calls `calibration_overlap` (token ids it has made) or `text_overlap` (texts, each
tokenised alone as the calibration set's are) in its `prepare` (files only: the tokenizer and the calibration
file) and reports `overlap_metrics` and `overlap_rows`; where some unit is flagged it also gives its verdict
without them (`flagged_verdicts`: `ppl` and `smoke` from their figures without them, `clean_…`; `vision` from
the checks of the cases not flagged).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from pydantic import Field

from evalsuite.contract.spec import Check, StrictModel
from evalsuite.inputs.calibration_set import (
    NGRAM,
    CalibrationSet,
    calibration_set,
    named_calibration_data,
    token_ids,
)
from evalsuite.protocol.task import RunContext

if TYPE_CHECKING:
    from evalsuite.protocol.side import Side


class CalibrationOptions(StrictModel):
    """The `[calibration]` section of a spec: the n-gram length, and the share of a window's (chat's,
    prompt's, question's) tokens overlapping the calibration set above which it is flagged."""

    ngram: int = Field(NGRAM, ge=4)
    flag_share: float = Field(0.05, ge=0.0, le=1.0)


@dataclass(frozen=True)
class Overlap:
    """Each evaluated unit's share of tokens overlapping a calibration set, which are flagged, and what the
    set was (`source`, `sha256`, `n_tokens`); `note` where the candidate named a set that is not read.
    `labels` describe the units in report.md's rows; `named`: they are the units' unique names (a prompt's
    id, a case's name), listed in results.json instead of the units' indices."""

    unit: str
    shares: np.ndarray
    flagged: np.ndarray
    lengths: np.ndarray  # each unit's token count
    options: CalibrationOptions
    source: str | None = None
    sha256: str | None = None
    n_tokens: int = 0
    note: str | None = None
    labels: tuple[str, ...] = ()
    named: bool = False


def calibration_overlap(
    options: CalibrationOptions,
    context: RunContext,
    ref: Side,
    ckpt: Side,
    sequences: Sequence[np.ndarray],
    unit: str,
    labels: Sequence[str] = (),
) -> Overlap | None:
    """The overlap of each of `sequences` (token ids by the reference's tokenizer; `labels` describe them)
    with the calibration set: `--calibration`'s file, else the file the candidate's metadata names. None where
    there is neither; an `Overlap` with only a `note` where the metadata names data that is not a file."""
    return _overlap(options, context, ref, ckpt, lambda _: sequences, unit, labels)


def text_overlap(
    options: CalibrationOptions, context: RunContext, ref: Side, ckpt: Side, texts: dict[str, str], unit: str
) -> Overlap | None:
    """`calibration_overlap` of named texts (`texts`: a prompt's id or a case's name → its text), each
    tokenised alone by the reference's tokenizer without special tokens or chat template, as the calibration
    set's texts are: the template's boilerplate (role markers, a default system prompt) is in every prompt
    and would otherwise count as overlap. Nothing is tokenised where no calibration set is given or named."""
    names = list(texts)
    made = _overlap(
        options,
        context,
        ref,
        ckpt,
        lambda tokenizer: [token_ids(tokenizer, texts[n]) for n in names],
        unit,
        names,
    )
    return None if made is None else replace(made, named=True)


def _overlap(
    options: CalibrationOptions,
    context: RunContext,
    ref: Side,
    ckpt: Side,
    tokenised: Callable[[Any], Sequence[np.ndarray]],
    unit: str,
    labels: Sequence[str],
) -> Overlap | None:
    """The overlap of the units `tokenised(tokenizer)` makes (the reference's tokenizer: the candidate's where
    the reference is a recording) with the calibration set."""
    path, note = (Path(context.calibration_file), None) if context.calibration_file else (None, None)
    if path is None and ckpt.checkpoint is not None:
        path, note = named_calibration_data(ckpt.checkpoint.path)
    if path is None and note is None:
        return None
    side = ckpt if ref.is_recorded else ref
    tokenizer = side.tokenizer
    sequences = tokenised(tokenizer)
    if path is None:
        lengths = np.array([len(s) for s in sequences])
        empty = np.zeros(len(sequences))
        return Overlap(unit, empty, empty.astype(bool), lengths, options, note=note, labels=tuple(labels))
    key = (
        "calibration",
        str(path.resolve()),
        path.stat().st_mtime_ns,
        side.checkpoint.tokenizer_sha256,
        options.ngram,
    )
    found: CalibrationSet = context.shared.get(key, lambda: calibration_set(path, tokenizer, options.ngram))
    shares = found.shares(sequences)
    return Overlap(
        unit,
        shares,
        shares > options.flag_share,
        np.array([len(s) for s in sequences]),
        options,
        source=found.source,
        sha256=found.sha256,
        n_tokens=found.n_tokens,
        labels=tuple(labels),
    )


def overlap_metrics(overlap: Overlap) -> dict[str, Any]:
    """results.json's account of the overlap: the set (`calibration_source`, `_sha256`, `_tokens`), the share
    of all evaluated tokens that overlap it, the largest unit's share, the bound and the flagged units."""
    if overlap.source is None:
        return {"calibration_note": overlap.note}
    unit = overlap.unit
    flagged = np.flatnonzero(overlap.flagged)
    return {
        "calibration_source": overlap.source,
        "calibration_sha256": overlap.sha256,
        "calibration_tokens": overlap.n_tokens,
        "calibration_ngram": overlap.options.ngram,
        "calibration_overlap_share": _token_share(overlap),
        "calibration_overlap_max": float(overlap.shares.max()) if len(overlap.shares) else 0.0,
        "calibration_flag_share": overlap.options.flag_share,
        f"calibration_flagged_{unit}s": len(flagged),
        f"calibration_flagged_{unit}_list": ",".join(
            overlap.labels[i] if overlap.named else str(i) for i in flagged
        ),
    }


def _token_share(overlap: Overlap) -> float:
    """The share of every evaluated token (the units weighted by their lengths) that overlap the set."""
    weights = overlap.lengths.astype(np.float64)
    return float((overlap.shares * weights).sum() / weights.sum()) if weights.sum() else 0.0


def overlap_rows(overlap: Overlap) -> list[dict[str, Any]]:
    """report.md's rows: each flagged unit with its overlap."""
    rows = []
    for i in np.flatnonzero(overlap.flagged):
        row: dict[str, Any] = {"table": "overlapping the calibration set (flagged)"}
        row[overlap.unit] = overlap.labels[i] if overlap.named else int(i)
        if overlap.labels and not overlap.named:
            row["which"] = overlap.labels[i]
        row["overlap share"] = float(overlap.shares[i])
        rows.append(row)
    return rows


def flagged_verdicts(with_them: Sequence[Check], without_them: Sequence[Check]) -> dict[str, str]:
    """`verdict_with_flagged` and `verdict_without_flagged`: whether every check passes with the flagged
    units, and whether every check made without them passes."""
    return {
        "verdict_with_flagged": "pass" if all(c.passed for c in with_them) else "fail",
        "verdict_without_flagged": "pass" if all(c.passed for c in without_them) else "fail",
    }
