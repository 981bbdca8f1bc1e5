"""The validation section of a Hugging Face model card, rendered from results.json alone.

Every number on the card is a value of results.json, shown as the report shows it (`format_number`),
except the relative PPL increase, which is `ppl_ratio` − 1 in percent. Nothing is looked up elsewhere, so the
card can be re-rendered anywhere and checked against the document it came from. What was *not* run is as much
a part of the card as what was: the caveats are derived from the tasks present, skipped or failed to run.
"""

from __future__ import annotations

import math
from pathlib import PurePath
from typing import Any

import yaml

from evalsuite.reporting.diff_report import (
    baseline_caveats,
    check_sample,
    difference_caveats,
    failed_prompts,
    format_number,
    machine_lines,
    replay_caveats,
    threshold_caveats,
    verdict_paragraph,
    with_stderr,
)
from evalsuite.reporting.model_card_tables import (
    calibration_overlap,
    chat_splits,
    greedy_answers,
    long_answers,
    speculative_decoding,
    tool_calls,
)
from evalsuite.reporting.model_card_tables import measured as _measured
from evalsuite.reporting.model_card_tables import table_row as _row

WIKITEXT = "wikitext-2-raw-v1"
FULL_VOCABULARY = "full-vocabulary"

# What a reader loses when a task evalsuite knows did not run, in the order the caveats are listed.
# The intref entry names the execution the PPL came from; `{execution}` is filled from the checkpoint format.
MISSING_WHEN_NOT_RUN = {
    "ppl": "no perplexity, KL divergence or same-top-token measurement",
    "smoke": "no greedy smoke prompts: generations were not compared with the reference",
    "vision": "no vision check was run: image+text generation and vision-tower features were not compared",
    "tensors": "the files were not verified tensor by tensor",
    "intref": "no integer W4A8 reference execution: the quantized PPL is that of {execution} execution",
}
# Who executed the quantized side when `intref` did not, by checkpoint format; the hf backend otherwise.
EXECUTION_BY_FORMAT = {"exl3": "exllamav3's"}
DEFAULT_EXECUTION = "Transformers'"

# (metric, model-index type, model-index name): the ppl metrics that describe the candidate itself.
MODEL_INDEX_METRICS = (
    ("ppl_ckpt", "perplexity", "Perplexity"),
    ("ppl_ratio", "perplexity_ratio", "PPL ratio to the reference"),
    ("kld_mean", "kl_divergence", "Mean KL divergence from the reference"),
    ("same_top_p", "same_top_token", "Same top token as the reference (rate)"),
)


def side_name(side: dict[str, Any]) -> str:
    """A side's name on the card: the last component of its path (a folder, or a hub id)."""
    return PurePath(side["path"]).name or side["path"]


def model_name(results: dict[str, Any]) -> str:
    """The candidate's name: the model-index `name`, the ckpt folder name."""
    return side_name(results["ckpt"])


def describe_corpus(corpus: str) -> str:
    """The scored text in words, from the `corpus` metric of the ppl task."""
    if corpus == WIKITEXT:
        return "WikiText-2 raw test split"
    if corpus == "python-docs":
        return "the Python Language Reference topics shipped with CPython (offline corpus)"
    if corpus.startswith("file:"):
        return f"the text file `{corpus.removeprefix('file:')}`"
    return f"the corpus `{corpus}`"


def _dataset(corpus: str) -> dict[str, str]:
    """The model-index `dataset` of a corpus: a hub data set where there is one, the corpus id otherwise."""
    if corpus == WIKITEXT:
        return {
            "name": "WikiText-2 (raw)",
            "type": "Salesforce/wikitext",
            "config": WIKITEXT,
            "split": "test",
        }
    if corpus == "python-docs":
        return {"name": "Python Language Reference topics (CPython pydoc_data)", "type": "python-docs"}
    if corpus.startswith("file:"):
        return {"name": corpus.removeprefix("file:"), "type": "text-file"}
    return {"name": corpus, "type": corpus}


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def model_index(results: dict[str, Any]) -> dict[str, Any]:
    """The Hugging Face `model-index` front matter as data: the candidate's ppl metrics on its corpus.

    Values are the results.json floats rounded to the digits the report shows (4 significant): a card
    claims no more precision than the error bars allow. A non-finite value is left out, as the hub's
    metadata does not take NaN; with no ppl measurement `results` is an empty list.
    """
    ppl = _measured(results["tasks"].get("ppl"))
    metrics = [
        {"type": kind, "value": float(format_number(float(ppl[key]))), "name": name}
        for key, kind, name in MODEL_INDEX_METRICS
        if _is_number(ppl.get(key)) and math.isfinite(ppl[key])
    ]
    entries = []
    if metrics:
        entries.append(
            {
                "task": {"type": "text-generation"},
                "dataset": _dataset(str(ppl.get("corpus", "unknown"))),
                "metrics": metrics,
            }
        )
    return {"model-index": [{"name": model_name(results), "results": entries}]}


def _front_matter(results: dict[str, Any]) -> list[str]:
    body = yaml.safe_dump(model_index(results), sort_keys=False, allow_unicode=True, default_flow_style=False)
    return ["---", body.rstrip("\n"), "---", ""]


def _header(results: dict[str, Any]) -> list[str]:
    ckpt, ref = results["ckpt"], results["ref"]
    tasks = ", ".join(f"`{name}` ({entry['status']})" for name, entry in results["tasks"].items())
    return [
        "## Validation against the reference",
        "",
        f"Verdict: **{results['verdict'].upper()}**. Candidate `{model_name(results)}` ({ckpt['format']}), "
        f"reference `{side_name(ref)}` ({ref['format']}), compared by evalsuite. "
        f"Tasks: {tasks or 'none'}.",
        "",
        *verdict_paragraph(results),
    ]


def _window_starts(value: Any) -> str:
    """`window_starts` as a list for people: a comma-separated string (or a list) with spaces after commas."""
    items = value if isinstance(value, list) else str(value).split(",")
    return ", ".join(str(item).strip() for item in items)


def _protocol(results: dict[str, Any]) -> list[str]:
    lines = ["### Protocol", ""]
    entry = results["tasks"].get("ppl")
    m = _measured(entry)
    if not m:
        lines += [_not_measured("ppl", entry), ""]
        return lines
    # Each part is said only when results.json has the numbers for it: never a protocol default.
    windows = "windows"
    if "n_windows" in m:
        windows = f"{format_number(m['n_windows'])} windows"
    if "window_tokens" in m:
        windows += f" of {format_number(m['window_tokens'])} tokens"
    if "window_starts" in m:
        windows += f" starting at tokens {_window_starts(m['window_starts'])}"
    sentence = f"Perplexity (PPL) on {describe_corpus(str(m.get('corpus', 'unknown')))}: {windows}"
    if "scored_first" in m and "scored_last" in m:
        sentence += (
            f"; in each window the logits at positions {format_number(m['scored_first'])} to "
            f"{format_number(m['scored_last'])} are scored, each predicting the next token"
        )
    if "n_scored_tokens" in m:
        sentence += f"; {format_number(m['n_scored_tokens'])} scored tokens in all"
    lines.append(sentence + ".")
    if "tokens_sha256" in m:
        lines.append(f"Both sides were fed the same token ids (`tokens_sha256` `{m['tokens_sha256']}`).")
    lines += [
        "KL divergence (KLD) and the same-top-token rate compare the candidate's next-token distribution "
        "with the reference's at every scored position.",
        "",
    ]
    return lines


def _not_measured(task: str, entry: dict[str, Any] | None) -> str:
    if entry is None:
        return f"`{task}` was not run."
    return f"`{task}` {_status_words(entry)}."


def _status_words(entry: dict[str, Any]) -> str:
    """`skipped: reason` / `failed to run: reason` for a task that did not produce metrics."""
    words = "skipped" if entry["status"] == "skipped" else "failed to run"
    reason = entry.get("reason")
    return f"{words}: {reason}" if reason else words


def _relative_increase(m: dict[str, Any]) -> str:
    """`ppl_ratio` − 1 in percent, with the paired ln PPL ratio and its error bar where measured."""
    ratio = m.get("ppl_ratio")
    if not _is_number(ratio):
        return "—"
    text = f"{(ratio - 1) * 100:+.2f} %" if math.isfinite(ratio) else format_number(ratio)
    if "ppl_ratio_stderr" in m:
        text += f" (ratio {with_stderr(m, 'ppl_ratio')})"
    elif "ln_ppl_ratio" in m:
        text += f" (ln PPL ratio {with_stderr(m, 'ln_ppl_ratio')})"
    return text


def _measured_or_dash(m: dict[str, Any], name: str) -> str:
    return with_stderr(m, name) if name in m else "—"


def _results_table(results: dict[str, Any]) -> list[str]:
    """The PPL table (or why there is none), then the paired downstream accuracy where `lmeval` ran."""
    return [
        "### Results",
        "",
        *_ppl_results(results),
        *chat_splits(results),
        *calibration_overlap(results),
        *greedy_answers(results),
        *tool_calls(results),
        *long_answers(results),
        *speculative_decoding(results),
        *_downstream_results(results),
    ]


def _ppl_results(results: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    entry = results["tasks"].get("ppl")
    m = _measured(entry)
    if not m:
        return [_not_measured("ppl", entry), ""]
    ckpt, ref = results["ckpt"], results["ref"]
    lines += [
        "| checkpoint | PPL | relative PPL increase | KLD (mean ± stderr) | same-top-token rate |",
        "| --- | --- | --- | --- | --- |",
        _row(
            [
                f"`{side_name(ref)}` (reference, {ref['format']})",
                _measured_or_dash(m, "ppl_ref"),
                "—",
                "—",
                "—",
            ]
        ),
        _row(
            [
                f"`{model_name(results)}` (candidate, {ckpt['format']})",
                _measured_or_dash(m, "ppl_ckpt"),
                _relative_increase(m),
                _measured_or_dash(m, "kld_mean"),
                _measured_or_dash(m, "same_top_p"),
            ]
        ),
        "",
    ]
    # A list, not a paragraph: each line is one statement a reader checks against results.json.
    if "n_scored_tokens" in m:
        n = format_number(m["n_scored_tokens"])
        lines.append(
            f"- sample size: {n} scored tokens per side; ± is one standard error, the larger of the "
            "per-token one and the one from the window means (marked (w))"
        )
    lines.append(f"- KLD estimator: {m.get('kld_estimator') or 'not stated in results.json'}")
    spread = [(label, key) for label, key in _KLD_SPREAD if key in m]
    if spread:
        values = ", ".join(f"{label} {format_number(m[key])}" for label, key in spread)
        lines.append(f"- KLD distribution: {values}")
    if "delta_p_mean" in m or "rms_delta_p" in m:
        lines.append(
            "- change of the true token's probability (Δp): "
            f"mean {_measured_or_dash(m, 'delta_p_mean')}, RMS {_measured_or_dash(m, 'rms_delta_p')}"
        )
    return [*lines, ""]


def lmeval_metrics(m: dict[str, Any]) -> list[str]:
    """The `<task>.<metric>` prefixes of an lmeval result, in results.json order (each has a `.n` metric)."""
    return [name.removesuffix(".n") for name, value in m.items() if name.endswith(".n") and _is_number(value)]


def _downstream_results(results: dict[str, Any]) -> list[str]:
    m = _measured(results["tasks"].get("lmeval"))
    prefixes = lmeval_metrics(m)
    if not prefixes:
        return []
    lines = [
        "Downstream accuracy (lm-eval), both checkpoints on the same documents, compared per document:",
        "",
        "| lm-eval task and metric | documents | reference | candidate | Δ (paired) | recovery "
        "| correct → wrong | wrong → correct | McNemar p | choice KLD |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for p in prefixes:
        lines.append(
            _row(
                [
                    f"`{p}`",
                    format_number(m[f"{p}.n"]),
                    _measured_or_dash(m, f"{p}.ref"),
                    _measured_or_dash(m, f"{p}.ckpt"),
                    _measured_or_dash(m, f"{p}.delta"),
                    _measured_or_dash(m, f"{p}.recovery"),
                    _measured_or_dash(m, f"{p}.flips_c2w"),
                    _measured_or_dash(m, f"{p}.flips_w2c"),
                    _measured_or_dash(m, f"{p}.mcnemar_p"),
                    _measured_or_dash(m, f"{p}.choice_kld_mean"),
                ]
            )
        )
    lines += [
        "",
        "- ± is one standard error; Δ is candidate − reference with the standard error of the per-document "
        "differences (paired); recovery is candidate / reference",
        "- flips: documents answered correctly by one side only; McNemar's exact test asks whether one "
        "direction outnumbers the other; choice KLD: KL divergence between the two sides' distributions "
        "over a question's choices (softmax of the per-choice log-likelihoods)",
        f"- lm-eval `{m.get('lm_eval_version', 'unknown')}`, few-shot: "
        f"{format_number(m.get('num_fewshot'))}, documents per task: {format_number(m.get('limit'))}",
        "",
    ]
    return lines


# Percentile labels are the metric names themselves, so the card states no number results.json does not.
_KLD_SPREAD = (
    ("median", "kld_median"),
    ("`kld_p90`", "kld_p90"),
    ("`kld_p99`", "kld_p99"),
    ("`kld_p999`", "kld_p999"),
    ("max", "kld_max"),
)


def _checks(results: dict[str, Any]) -> list[str]:
    lines = [
        "### Checks",
        "",
        "| task | check | value | op | threshold | result |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for task, entry in results["tasks"].items():
        checks = entry.get("checks", [])
        # A task without checks still gets a row, so a skipped or failed task is visible in the table too.
        if not checks:
            status = entry["status"]
            if status in ("skipped", "error"):
                status = _status_words(entry)
            lines.append(_row([task, "(no checks)", "—", "—", "—", status]))
        for name in entry.get("not_comparable") or {}:
            lines.append(_row([task, f"{name}_vs_baseline", "—", "—", "—", "not comparable"]))
        for check in checks:
            lines.append(
                _row(
                    [
                        task,
                        check_sample(entry, check),
                        format_number(check["value"]),
                        check["op"],
                        format_number(check["threshold"]),
                        "pass" if check["passed"] else "**FAIL**",
                    ]
                )
            )
    return [*lines, ""]


def caveats(results: dict[str, Any]) -> list[str]:
    """What the numbers do not show, derived from what was and was not run; one sentence per caveat."""
    tasks = results["tasks"]
    notes = difference_caveats(results) + threshold_caveats(results) + failed_prompts(results)
    notes += replay_caveats(results) + baseline_caveats(results)
    execution = EXECUTION_BY_FORMAT.get(results["ckpt"].get("format", ""), DEFAULT_EXECUTION)
    for task, missing in MISSING_WHEN_NOT_RUN.items():
        entry = tasks.get(task)
        if entry is None:
            notes.append(f"{missing.format(execution=execution)} (`{task}` not run)")
        elif entry["status"] in ("skipped", "error"):
            notes.append(f"{missing.format(execution=execution)} (`{task}` {_status_words(entry)})")
    for task, entry in tasks.items():
        if task not in MISSING_WHEN_NOT_RUN and entry["status"] in ("skipped", "error"):
            notes.append(f"`{task}` {_status_words(entry)}")
    # A vision case that could not run here (a video without torchvision) is a claim left unproven.
    if _measured(tasks.get("vision")).get("skipped_cases"):
        for row in tasks["vision"].get("details", []):
            if str(row.get("note", "")).startswith("skipped: "):
                notes.append(f"vision case `{row.get('case')}` {row['note']}")
    # An OCR case whose reference does not read its text: the candidate's reading was compared with nothing.
    for name, reason in (tasks.get("vision") or {}).get("null_reasons", {}).items():
        if name.endswith(".cer_delta"):
            notes.append(f"vision case `{name.rpartition('.')[0]}`: cer_delta not judged: {reason}")
    ppl = _measured(tasks.get("ppl"))
    lmeval = _measured(tasks.get("lmeval"))
    if lmeval_metrics(lmeval):
        names = ", ".join(f"`{t}`" for t in str(lmeval.get("lmeval_tasks", "")).split(",") if t)
        notes.append(
            f"downstream accuracy was measured on {names} only ({format_number(lmeval.get('n_documents'))} "
            "documents): a small sample of tasks, not broad accuracy parity"
        )
    else:
        notes.append("a PPL increase is not an accuracy drop: downstream accuracy was not measured")
    if "window_tokens" in ppl:
        notes.append(f"no long-context evaluation: windows of {format_number(ppl['window_tokens'])} tokens")
    else:
        notes.append("no long-context evaluation")
    if ppl.get("protocol_note"):
        notes.append(str(ppl["protocol_note"]))
    if ppl and ppl.get("corpus") != WIKITEXT:
        notes.append(
            f"the text is {describe_corpus(str(ppl.get('corpus', 'unknown')))}, not WikiText-2: "
            "the PPL numbers are not comparable with published WikiText-2 figures"
        )
    if "kld_mean" in ppl:
        estimator = ppl.get("kld_estimator")
        if not estimator:
            notes.append("the KLD estimator is not stated in results.json: treat KLD as an estimate")
        elif estimator != FULL_VOCABULARY:
            notes.append(f"KLD is an estimate ({estimator}), not the full-vocabulary KL divergence")
    return notes


def _environment(results: dict[str, Any]) -> list[str]:
    env = results.get("environment", {})
    # Versions and platform strings go in code spans: they are identifiers, not measurements.
    packages = ", ".join(f"{name} `{ver}`" for name, ver in env.get("packages", {}).items() if ver)
    device = env.get("device", "unknown")
    if env.get("device_name") and env["device_name"] != device:
        device += f" ({env['device_name']})"
    lines = ["### Environment", "", f"- packages: {packages or 'not recorded'}", f"- device: {device}"]
    lines.append(f"- dtype: {env.get('dtype', 'not recorded')}")
    lines += machine_lines(env)
    if env.get("python"):
        platform = f" on `{env['platform']}`" if env.get("platform") else ""
        lines.append(f"- Python `{env['python']}`{platform}")
    return [*lines, ""]


def render_model_card(results: dict[str, Any]) -> str:
    """The model card's validation section in markdown, from a results.json document alone.

    Args:
        results: a results.json document (schema `evalsuite.results/1`).

    Returns:
        `model-index` YAML front matter, then the verdict, Protocol, Results, Checks, Caveats and Environment.
    """
    lines = _front_matter(results) + _header(results) + _protocol(results) + _results_table(results)
    lines += _checks(results)
    lines += (
        ["### Caveats", ""]
        + [f"- {note[:1].upper()}{note[1:].rstrip('.')}." for note in caveats(results)]
        + [""]
    )
    lines += _environment(results)
    return "\n".join(lines)


def _allowed(margin: Any) -> str:
    """The KLD `within` the floor allows, in words: (1 + m) × the noise floor's KLD."""
    m = format_number(margin) if _is_number(margin) else "m"
    return f"(1 + {m}) × the noise floor's KLD"


def render_alternatives(comparison: dict[str, Any], chosen: str | None = None) -> str:
    """The model card's "Alternatives measured" section, from a compare.json document alone: every candidate
    measured against the same reference on the same text, the chosen one (a candidate name) marked.

    Args:
        comparison: a compare.json document (schema `evalsuite.compare/1`).
        chosen: the candidate this card is for, if any.
    """
    lines = ["### Alternatives measured", ""]
    lines.append(
        "Every candidate below was compared with the same reference on the same tokens "
        "(`evalsuite compare`); ★ marks the Pareto front of bits per weight against mean KLD."
    )
    if comparison.get("kld_floor") is not None:
        lines[-1] += (
            f" The noise floor (the reference again with BF16-sized noise on each decoder layer) is a mean "
            f"KLD of {format_number(comparison['kld_floor'])}. A candidate is *within* the floor only where "
            f"its mean KLD is shown to be at most {_allowed(comparison.get('kld_floor_margin'))} (the upper "
            "95% bound of its per-token KLD minus that multiple of the floor's, paired by token, "
            "window-clustered, Student's t, is at most 0), *above* where it is shown to exceed it, and "
            "*undetermined* otherwise."
        )
    head = ["candidate", "bits per weight", "PPL ratio", "mean KLD", "same top token", "vs floor"]
    lines += ["", _row(head)]
    lines.append("|" + " --- |" * 6)
    for r in comparison["candidates"]:
        name = f"**{r['name']}**" if r["name"] == chosen else r["name"]
        kld = format_number(r.get("kld_mean"))
        if r.get("kld_mean_stderr") is not None:
            kld += f" ± {format_number(r['kld_mean_stderr'])}"
        outcome = r.get("noise_floor")
        floor = outcome or "–"
        if outcome in ("above", "undetermined"):
            floor += f" (× {format_number(r.get('kld_floor_ratio'))})"
        cells = [name + (" ★" if r.get("pareto") else ""), format_number(r.get("bits_per_weight"))]
        cells += [format_number(r.get("ppl_ratio")), kld, format_number(r.get("same_top_p")), floor]
        lines.append(_row(cells))
    for pair in comparison.get("pairs", []):
        lines.append("")
        lines.append(f"- {pair['kld_verdict']}.")
    return "\n".join(lines) + "\n"
