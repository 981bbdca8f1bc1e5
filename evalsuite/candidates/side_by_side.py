"""The comparison of many candidates against one reference: `compare.json`, `compare.md` and the plots.

A row per candidate (bits per weight and bytes, the `ppl` figures, downstream Δ where `lmeval` ran), sorted
by bits per weight, the Pareto front of (bits per weight, KLD) marked; for each adjacent pair on the front,
the per-token differences of their KLDs and NLLs, paired by token, with window-clustered standard errors;
and the noise floor. Read from the candidates' results.json documents and per-token arrays alone: the same
runs give the same bytes, whichever executor made them.
"""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from evalsuite.contract.observation import Observation
from evalsuite.contract.results import COMPARE_SCHEMA as SCHEMA
from evalsuite.contract.results import SCHEMA_VERSION
from evalsuite.files.checkpoint import Checkpoint
from evalsuite.files.run_folder import RunFolder, write_atomic
from evalsuite.observers.kld_detail import read_tokens
from evalsuite.plotting import plots
from evalsuite.reporting.diff_report import format_number
from evalsuite.reporting.model_card import render_alternatives
from evalsuite.stats import claims, metrics
from evalsuite.tasks.lmeval import OBSERVER_NAME as LMEVAL_OBSERVER
from evalsuite.tasks.lmeval import compare_task

PPL_COLUMNS = (
    "ppl_ratio",
    "kld_mean",
    "kld_median",
    "kld_p99",
    "same_top_p",
    "top5_agreement",
    "delta_p_mean",
    "rms_delta_p",
    "kld_floor_ratio",
    "noise_floor",
)


def _bits(doc: dict[str, Any], ref: Checkpoint | None) -> tuple[float | None, int | None, str]:
    """Bits per weight and stored bytes: the `tensors` task's, else 8 × the candidate's bytes over the
    reference's parameters (the same definition, from the files)."""
    measured = doc["tasks"].get("tensors", {}).get("metrics", {})
    if measured.get("avg_bits_per_weight_all") is not None:
        return measured["avg_bits_per_weight_all"], measured.get("payload_bytes"), "tensors"
    path = doc["ckpt"].get("path")
    if ref is None or path is None:
        return None, None, "not measured"
    candidate = Checkpoint.open(path)
    params = sum(info.numel for info in ref.tensors.values())
    return 8 * candidate.total_bytes / params, candidate.total_bytes, "files"


def candidate_row(name: str, doc: dict[str, Any], ref: Checkpoint | None) -> dict[str, Any]:
    """One candidate's row of compare.json."""
    bpw, size, source = _bits(doc, ref)
    row: dict[str, Any] = {
        "name": name,
        "path": doc["ckpt"].get("path"),
        "format": doc["ckpt"].get("format"),
        "verdict": doc["verdict"],
        "bits_per_weight": bpw,
        "bits_per_weight_from": source,
        "bytes": size,
    }
    ppl = doc["tasks"].get("ppl", {}).get("metrics", {})
    for column in PPL_COLUMNS:
        row[column] = ppl.get(column)
    ln_se = ppl.get("ln_ppl_ratio_stderr_window")
    row["ppl_ratio_stderr"] = ppl["ppl_ratio"] * ln_se if ln_se is not None and "ppl_ratio" in ppl else None
    row["kld_mean_stderr"] = ppl.get("kld_mean_stderr_window")
    lm = doc["tasks"].get("lmeval", {}).get("metrics", {})
    row["downstream"] = {k: v for k, v in sorted(lm.items()) if k.endswith((".delta", ".delta_stderr"))}
    return row


def _claim(a: str, b: str, what: str, pair: dict[str, Any]) -> tuple[str, str]:
    """The outcome and sentence of one pairwise claim about a mean per-token difference B − A (lower is
    better): a candidate is called better only where the Holm-adjusted, window-clustered t test says so;
    otherwise the comparison is `undetermined`, and says why (too few windows, closer than the smallest
    difference the text detects, or not significant)."""
    value, se = pair[f"{what}_diff"], pair[f"{what}_diff_stderr"]
    p, mde, windows = pair[f"{what}_p_holm"], pair[f"{what}_mde"], pair["n_windows"]
    shown = f"{what.upper()} B − A {value:+.3g} ± {se:.2g}, window-clustered"
    if value == 0 and se == 0 and pair[f"{what}_max_abs_diff"] == 0:
        return "identical", f"{a} and {b} give every token the same {what.upper()}"
    if windows < claims.MIN_CLUSTERS:
        return "undetermined", f"{a} vs {b}: undetermined, {windows} window(s) are too few ({shown})"
    if p < claims.ALPHA:
        better, worse = (a, b) if value > 0 else (b, a)
        outcome = "a_better" if value > 0 else "b_better"
        by = f"{abs(value):.3g} ± {se:.2g}"
        return outcome, f"{better} is better than {worse} by {by} ({shown}; Holm p = {p:.2g})"
    if abs(value) < mde:
        return "undetermined", (
            f"{a} vs {b}: undetermined, closer than the smallest difference these {windows} windows detect "
            f"between them ({shown}; paired MDE {mde:.2g} at 80% power, two-sided α = "
            f"{pair['mde_alpha']:.2g}, Holm's strictest step)"
        )
    return "undetermined", f"{a} vs {b}: undetermined ({shown}; Holm p = {p:.2g})"


def paired_rows(out: Path, names: list[str], docs: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Per adjacent pair (A, B) on the front: mean per-token KLD_B − KLD_A and NLL_B − NLL_A with their
    window-clustered standard errors, two-sided p-values (t, windows − 1 degrees of freedom), Holm-adjusted
    over every claim of the comparison, the minimum detectable effect of that paired difference at the α the
    verdict uses (α / m for m claims: Holm's strictest step), and what they say."""
    rows = []
    for a, b in itertools.pairwise(names):
        ta, tb = (_tokens(out, n, docs[n]) for n in (a, b))
        if ta is None or tb is None:
            continue
        windows = int(np.unique(ta["window"]).size)
        pair: dict[str, Any] = {"a": a, "b": b, "n_tokens": int(ta["kld"].size), "n_windows": windows}
        for what, key in (("kld", "kld"), ("nll", "nll_ckpt")):
            est = metrics.paired_difference(ta[key], tb[key])
            se = metrics.clustered_stderr(tb[key] - ta[key], ta["window"])
            pair[f"{what}_diff"], pair[f"{what}_diff_stderr"] = est.value, se
            pair[f"{what}_max_abs_diff"] = float(np.max(np.abs(tb[key] - ta[key])))
            pair[f"{what}_p"] = claims.two_sided_p(est.value, se, windows)
        pair.update(downstream_pair(out, a, b))
        rows.append(pair)
    family = [row[f"{w}_p"] for row in rows for w in ("kld", "nll")]
    adjusted = iter(claims.holm(family))
    # The MDE at the level the verdict tests at: Holm rejects the smallest p below α / m first, the others
    # at α / (m − 1) … α, so α / m is the level that finds the difference whatever the other claims show.
    alpha = claims.ALPHA / max(1, sum(1 for p in family if not math.isnan(p)))
    for row in rows:
        row["mde_alpha"] = alpha
        for what in ("kld", "nll"):
            se = row[f"{what}_diff_stderr"]
            row[f"{what}_mde"] = claims.minimum_detectable_effect(se, row["n_windows"], alpha)
            row[f"{what}_p_holm"] = next(adjusted)
            row[f"{what}_outcome"], row[f"{what}_verdict"] = _claim(row["a"], row["b"], what, row)
    return rows


def _lmeval_observation(out: Path, name: str) -> Observation | None:
    """A candidate's lm-eval samples from its run folder (a copy of the reference has the reference's)."""
    folder = RunFolder(out / name).observations
    for role in ("ckpt", "ref"):
        found = sorted(folder.glob(f"{role}-{LMEVAL_OBSERVER}-*")) if folder.is_dir() else []
        if found and Observation.is_complete(found[0]):
            return Observation.load(found[0])
    return None


def downstream_pair(out: Path, a: str, b: str) -> dict[str, Any]:
    """Where `lmeval` ran on both: B's paired accuracy change over A per document, and the documents that
    flipped between them (`lmeval`'s own paired statistics, with A in the reference's place)."""
    first, second = _lmeval_observation(out, a), _lmeval_observation(out, b)
    if first is None or second is None:
        return {}
    values: dict[str, Any] = {}
    for task in second.meta["lm_eval_tasks"]:
        if task in first.meta["lm_eval_tasks"]:
            stats, _ = compare_task(task, first, second)
            keep = (".delta", ".delta_stderr", ".flips_c2w", ".flips_w2c", ".mcnemar_p")
            values.update({f"lmeval.{k}": v for k, v in stats.items() if k.endswith(keep)})
    return values


def _tokens(out: Path, name: str, doc: dict[str, Any]) -> dict[str, np.ndarray] | None:
    relative = doc["tasks"].get("ppl", {}).get("artifacts", {}).get("tokens")
    return read_tokens(out / name, relative) if relative else None


def build_comparison(
    out: Path, ref: str, names: list[str], docs: dict[str, dict[str, Any]]
) -> dict[str, Any]:
    """The compare.json document."""
    reference = Checkpoint.open(ref) if Path(ref, "config.json").is_file() else None
    rows = [candidate_row(name, docs[name], reference) for name in names]
    rows.sort(key=lambda r: (r["bits_per_weight"] is None, r["bits_per_weight"] or 0.0, r["kld_mean"] or 0.0))
    measured = [r for r in rows if r["bits_per_weight"] is not None and r["kld_mean"] is not None]
    front = metrics.pareto_front([r["bits_per_weight"] for r in measured], [r["kld_mean"] for r in measured])
    on_front = {r["name"] for r, f in zip(measured, front, strict=True) if f}
    for r in rows:
        r["pareto"] = r["name"] in on_front
    ppl = next((d["tasks"]["ppl"]["metrics"] for d in docs.values() if "ppl" in d["tasks"]), {})
    return {
        "schema": SCHEMA,
        "schema_version": SCHEMA_VERSION,
        "ref": ref,
        "kld_floor": ppl.get("kld_floor"),
        # The floor's draws (noise seeds) and the spread of their means: how much the floor itself moves.
        "kld_floor_draws": ppl.get("kld_floor_draws"),
        "kld_floor_draw_spread": ppl.get("kld_floor_draw_spread"),
        # `within` the floor: a mean KLD shown to be at most (1 + this) × the floor's.
        "kld_floor_margin": ppl.get("kld_floor_margin"),
        "candidates": rows,
        "pairs": paired_rows(out, [r["name"] for r in rows if r["pareto"]], docs),
        "artifacts": {"kld_vs_bpw": "kld_vs_bpw.png", "ppl_ratio_vs_bpw": "ppl_ratio_vs_bpw.png"},
    }


def floor_sentence(margin: float | None) -> str:
    """What `within`, `above` and `undetermined` the floor say, with the margin (m) the candidates were
    judged by."""
    m = "m" if margin is None else format_number(margin)
    return (
        f"*within*: the candidate's mean KLD is shown to be at most (1 + {m}) × the noise floor's KLD (the "
        f"upper 95% bound of the per-token kld − (1 + {m}) · floor, paired by token, window-clustered, "
        "Student's t, is at most 0); *above*: it is shown to exceed it; *undetermined*: neither."
    )


def render_compare_md(doc: dict[str, Any]) -> str:
    """compare.md: the table, the pairs on the front, the floor and the plots."""
    # The reference by its folder name: compare.json keeps its path; a report never prints this machine's.
    lines = [f"# Comparison against `{Path(str(doc['ref']).rstrip('/')).name or doc['ref']}`", ""]
    if doc["kld_floor"] is not None:
        lines += [
            f"Noise floor (the reference with BF16-sized noise): KLD {format_number(doc['kld_floor'])} "
            f"(mean of {doc.get('kld_floor_draws')} noise draws, which spread by "
            f"{format_number(doc.get('kld_floor_draw_spread'))}). "
            + floor_sentence(doc.get("kld_floor_margin")),
            "",
        ]
    head = ["candidate", "front", "bpw", "bytes", "ppl ratio", "KLD mean", "KLD median", "KLD p99"]
    head += ["same top", "top-5", "Δp mean", "KLD / floor", "vs floor", "verdict"]
    lines += ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in doc["candidates"]:
        kld = format_number(r["kld_mean"])
        if r["kld_mean_stderr"] is not None:
            kld += f" ± {format_number(r['kld_mean_stderr'])}"
        cells = [r["name"], "★" if r["pareto"] else "", format_number(r["bits_per_weight"])]
        cells += [format_number(r["bytes"]), format_number(r["ppl_ratio"]), kld]
        cells += [format_number(r[c]) for c in ("kld_median", "kld_p99", "same_top_p", "top5_agreement")]
        cells += [format_number(r["delta_p_mean"]), format_number(r["kld_floor_ratio"])]
        cells += [r["noise_floor"] or "", r["verdict"]]
        lines.append("| " + " | ".join(cells) + " |")
    if doc["pairs"]:
        lines += ["", "## Adjacent candidates on the front (paired by token)", ""]
        for p in doc["pairs"]:
            lines += [f"- {p['kld_verdict']}", f"- {p['nll_verdict']}"]
            flips = {k: v for k, v in p.items() if k.startswith("lmeval.")}
            if flips:
                shown = ", ".join(f"{k.removeprefix('lmeval.')} {format_number(v)}" for k, v in flips.items())
                lines.append(f"- downstream, {p['b']} − {p['a']}: {shown}")
    downstream = [r for r in doc["candidates"] if r["downstream"]]
    if downstream:
        lines += ["", "## Downstream (lmeval, candidate − reference)", ""]
        for r in downstream:
            shown = ", ".join(f"{k} {format_number(v)}" for k, v in r["downstream"].items())
            lines.append(f"- {r['name']}: {shown}")
    shown = {"kld_vs_bpw": "KLD vs bits per weight", "ppl_ratio_vs_bpw": "PPL ratio"}
    for key, title in shown.items():
        if key in doc["artifacts"]:
            lines += ["", f"![{title}]({doc['artifacts'][key]})"]
    return "\n".join([*lines, ""])


def write_comparison(
    out: Path, ref: str, names: list[str], docs: dict[str, dict[str, Any]], draw_plots: bool = True
) -> dict[str, Any]:
    """compare.json, compare.md and (unless `draw_plots` is false) the two plots, atomically; returns
    compare.json's document."""
    doc = build_comparison(out, ref, names, docs)
    points = [r for r in doc["candidates"] if r["bits_per_weight"] is not None]
    if not draw_plots:
        doc["artifacts"] = {}
    for key, column, floor, label in (
        ("kld_vs_bpw", "kld_mean", doc["kld_floor"], "mean KLD (nats)"),
        ("ppl_ratio_vs_bpw", "ppl_ratio", None, "PPL ratio"),
    ):
        if key not in doc["artifacts"]:
            continue
        usable = [r for r in points if r[column] is not None]
        plots.metric_vs_bpw(
            [r["name"] for r in usable],
            [r["bits_per_weight"] for r in usable],
            [r[column] for r in usable],
            [r[f"{column}_stderr"] or 0.0 for r in usable],
            [r["pareto"] for r in usable],
            out / doc["artifacts"][key],
            label,
            floor,
        )
    write_atomic(out / "compare.json", json.dumps(_finite(doc), indent=2, allow_nan=False) + "\n")
    write_atomic(out / "compare.md", render_compare_md(doc))
    write_atomic(out / "model-card-alternatives.md", render_alternatives(doc))
    return doc


def _finite(value: Any) -> Any:
    """Strict JSON: a non-finite number (no error estimate from one window, say) becomes null."""
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    if isinstance(value, float) and not np.isfinite(value):
        return None
    return value
