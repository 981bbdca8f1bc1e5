"""Reports rendered from results.json alone: results.json itself, report.md (the diff) and the console table.

Rendering needs nothing but the results document, so a run can be re-rendered later, anywhere.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from evalsuite.files.run_folder import RunFolder, write_atomic
from evalsuite.stats import claims

SIGNIFICANT_DIGITS = 4


def format_number(value: Any, digits: int = SIGNIFICANT_DIGITS) -> str:
    """A metric for people: `digits` significant digits (4: what an error bar of a few percent supports),
    ints and strings as they are; results.json keeps every digit."""
    if isinstance(value, bool) or value is None:
        return "—" if value is None else str(value).lower()
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return f"{value:.{digits}g}"
    return str(value)


def stderr_of(metrics: dict[str, Any], name: str) -> tuple[float | None, str]:
    """The larger of a metric's per-token and window-clustered standard errors, and which one it is
    (`token` or `window`); (None, "") when the task reported neither."""
    token, window = metrics.get(f"{name}_stderr"), metrics.get(f"{name}_stderr_window")
    token = token if isinstance(token, float) else None
    window = window if isinstance(window, float) else None
    if window is not None and (token is None or window > token):
        return window, "window"
    return (token, "token") if token is not None else (None, "")


def with_stderr(metrics: dict[str, Any], name: str) -> str:
    """`value ± stderr` when the task reported a standard error for the metric: the larger of the
    per-token and the window-clustered one, marked `(w)` when it is the window-clustered one."""
    text = format_number(metrics.get(name))
    err, kind = stderr_of(metrics, name)
    if err is None:
        return text
    return f"{text} ± {format_number(err)}" + (" (w)" if kind == "window" else "")


def summary_rows(results: dict[str, Any]) -> list[list[str]]:
    """Rows of `task | metric | ref | ckpt | Δ | threshold | verdict`.

    A metric measured on each side (`X_ref`, `X_ckpt`) is one row with both values and their change; the
    threshold of a paired metric is its `X_ratio` check. Every other check is a row of its own.
    """
    rows = []
    for task, entry in results["tasks"].items():
        m = entry.get("metrics", {})
        checks = {c["name"]: c for c in entry.get("checks", [])}
        used = set()
        if entry["status"] in ("skipped", "error"):
            rows.append([task, "—", "", "", "", "", f"{entry['status']}: {entry.get('reason', '')}"])
            continue
        for name in m:
            if not name.endswith("_ref") or f"{name[:-4]}_ckpt" not in m:
                continue
            base = name[:-4]
            ref, ckpt = m[name], m[f"{base}_ckpt"]
            delta = ""
            if isinstance(ref, int | float) and isinstance(ckpt, int | float) and ref:
                delta = f"{(ckpt / ref - 1) * 100:+.2f}%"
            check = checks.get(f"{base}_ratio")
            if check is not None:
                used.add(check["name"])
            rows.append(
                [
                    task,
                    base,
                    with_stderr(m, name),
                    with_stderr(m, f"{base}_ckpt"),
                    delta,
                    _threshold(check),
                    _verdict(check),
                ]
            )
        for name, check in checks.items():
            if name in used:
                continue
            # A check on a metric shows it with its error bar; a derived check (`kld_mean_vs_baseline`)
            # shows the value it compared.
            value = with_stderr(m, name) if name in m else format_number(check["value"])
            shown = check_sample(entry, check)
            rows.append([task, shown, "", value, "", _threshold(check), _verdict(check)])
        for name in entry.get("not_comparable") or {}:
            value = with_stderr(m, name) if name in m else ""
            rows.append([task, f"{name}_vs_baseline", "", value, "", "", "not comparable"])
    return rows


def check_sample(entry: dict[str, Any], check: dict[str, Any]) -> str:
    """A check's metric as `checked_name` says it, with the sample its metric was measured on where that is
    not the task's whole one (`moe`'s fed windows): `mean_topk_overlap (on the fed windows 0, 7 of 8: 1,024
    tokens per MoE layer)`."""
    name = checked_name(check)
    identity = entry.get("identity") or {}
    metric = str(check["name"]).removesuffix("_vs_baseline")
    sample = (identity.get("metric_samples") or {}).get(metric)
    words = ((identity.get("samples") or {}).get(sample) or {}).get("words") if sample else None
    return f"{name} ({words})" if words else name


def significant_differences(results: dict[str, Any]) -> tuple[list[dict[str, Any]], int]:
    """Every paired difference from the reference the tasks tested (results.json's `differences`) whose p,
    adjusted by Holm's correction over all of them, is below 0.05, each with its task, its adjusted p and
    the checks that cover it (empty: none does); and how many were tested."""
    tested = _tested_differences(results)
    return _significant(tested), len(tested)


def _significant(tested: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [d for d in tested if d["p_holm"] < claims.ALPHA]


def _undetermined_unchecked(tested: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Of the tested differences (`_tested_differences`), those no check covers whose candidate side is the
    worse one but whose Holm-adjusted p is not below 0.05: a drop that neither a threshold nor the data
    decide, said beside the verdict as undetermined rather than left to a table."""
    return [d for d in tested if d["p_holm"] >= claims.ALPHA and d.get("worse") and not d["checks"]]


def _untested_unchecked(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The differences no check covers whose candidate side is the worse one but whose p could not be
    computed (too few windows for a test, `claims.MIN_CLUSTERS`): undetermined as well, each with why
    (`no_p`), rather than left out of a list that holds only what was tested."""
    return [
        {**d, "no_p": _no_p_reason(results["tasks"][d["task"]])}
        for d in _differences(results)
        if not isinstance(d.get("p"), int | float) and d.get("worse") and not d["checks"]
    ]


def _no_p_reason(entry: dict[str, Any]) -> str:
    windows = (entry.get("metrics") or {}).get("n_windows")
    if isinstance(windows, int) and windows < claims.MIN_CLUSTERS:
        return f"p cannot be computed: {windows} windows, a paired test needs at least {claims.MIN_CLUSTERS}"
    return f"p cannot be computed: fewer than {claims.MIN_CLUSTERS} windows or documents, or no finite error"


def _differences(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Every difference results.json records, with its task and the checks that cover it."""
    return [
        {**d, "task": task, "checks": _covering(entry, d)}
        for task, entry in results["tasks"].items()
        for d in entry.get("differences") or []
    ]


def _tested_differences(results: dict[str, Any]) -> list[dict[str, Any]]:
    tested = [d for d in _differences(results) if isinstance(d.get("p"), int | float)]
    if any(not isinstance(d.get("p_holm"), int | float) for d in tested):  # written without it: adjust here
        adjusted = claims.holm([float(d["p"]) for d in tested])
        tested = [{**d, "p_holm": p} for d, p in zip(tested, adjusted, strict=True)]
    return tested


def _covering(entry: dict[str, Any], difference: dict[str, Any]) -> list[str]:
    about = set(difference.get("metrics") or [])
    checks = entry.get("checks", [])
    return [c["name"] for c in checks if str(c["name"]).removesuffix("_vs_baseline") in about]


def difference_sentence(d: dict[str, Any]) -> str:
    """One significant difference as the verdict's paragraph and the caveats say it."""
    covered = (
        f"checked by {', '.join(f'`{c}`' for c in d['checks'])}" if d["checks"] else "which no check covers"
    )
    side = "worse" if d["worse"] else "better"
    return (
        f"{d['name']} ({d['task']}): {d['said']}, the candidate {side} ({d['test']}: p = "
        f"{format_number(d['p'], 2)}, Holm p = {format_number(d['p_holm'], 2)}), {covered}"
    )


def verdict_paragraph(results: dict[str, Any]) -> list[str]:
    """What the data show beside the verdict: every difference from the reference significant after Holm
    over all the paired tests the report and the card tabulate, whether or not a check covers it; said
    also when there is none; then the unchecked drops the data do not decide, tested or too few to test.
    Empty for a results.json that records no paired difference."""
    tested = _tested_differences(results)
    unsettled = _undetermined_unchecked(tested) + _untested_unchecked(results)
    lines: list[str] = []
    family = "significant after Holm's correction over every paired test of the candidate against the "
    family += "reference that this report tabulates (results.json's `differences`)"
    if tested and not (shown := _significant(tested)):
        lines = [f"No difference from the reference is {family}.", ""]
    elif tested:
        lines = [f"Beside the verdict, the data show these differences from the reference ({family}):", ""]
        lines += [*[f"- {difference_sentence(d)}." for d in shown], ""]
    if unsettled:
        lines += [
            "Undetermined beside the verdict (the candidate on the worse side, no check covering it, not "
            "significant after Holm's correction or too few windows to test: the data show neither a "
            "difference nor its absence):",
            "",
            *[f"- {undetermined_sentence(d)}." for d in unsettled],
            "",
        ]
    return lines


def undetermined_sentence(d: dict[str, Any]) -> str:
    """One unchecked drop the data do not decide, as the verdict's paragraph says it."""
    if "no_p" in d:
        return f"{d['name']} ({d['task']}): {d['said']} ({d['test']}: {d['no_p']})"
    return (
        f"{d['name']} ({d['task']}): {d['said']} ({d['test']}: p = {format_number(d['p'], 2)}, Holm p = "
        f"{format_number(d['p_holm'], 2)})"
    )


def difference_caveats(results: dict[str, Any]) -> list[str]:
    """One caveat per difference the data show (`significant_differences`), whatever the verdict."""
    shown, _ = significant_differences(results)
    return [f"the data show a difference: {difference_sentence(d)}" for d in shown]


def baseline_caveats(results: dict[str, Any]) -> list[str]:
    """The metrics a baseline was not compared on, by task, with why (results.json's `not_comparable`)."""
    notes = []
    for task, entry in results["tasks"].items():
        for name, why in (entry.get("not_comparable") or {}).items():
            notes.append(f"`{task}.{name}` was not compared with the baseline: {why}")
    return notes


def checked_name(check: dict[str, Any]) -> str:
    """A check's metric as the reports name it: `kld_mean`, or `kld_mean (upper95)` for a check judged on a
    confidence bound of the metric."""
    return f"{check['name']} ({check['on']})" if check.get("on") else str(check["name"])


def _threshold(check: dict[str, Any] | None) -> str:
    return "" if check is None else f"{checked_name(check)} {check['op']} {format_number(check['threshold'])}"


def _verdict(check: dict[str, Any] | None) -> str:
    return "" if check is None else ("pass" if check["passed"] else "FAIL")


def _cell(value: Any) -> str:
    """A value as one markdown table cell: pipes escaped, newlines as <br>."""
    text = "" if value is None else format_number(value)
    text = text.replace("|", "\\|").replace("\r", "").replace("\n", "<br>")
    # Generated text can hold control characters (a random model's bytes): show them, never emit them.
    return "".join(ch if ch.isprintable() else f"\\x{ord(ch):02x}" for ch in text)


def side_label(side: dict[str, Any]) -> str:
    """A side as a reader names it: its folder name and format (the full path is in results.json)."""
    path = str(side.get("path", ""))
    name = path.rstrip("/").rsplit("/", 1)[-1] or path
    return f"`{name}` ({side.get('format', 'unknown format')})"


def _metric_rows(entry: dict[str, Any]) -> list[str]:
    """The task's metrics: those with a meaning given first, each with it, the rest folded below."""
    metrics = entry.get("metrics", {})
    described = entry.get("descriptions", {})
    nulls = entry.get("null_reasons", {})
    shown = [name for name in metrics if name in described]
    rest = [
        name for name in metrics if name not in described and not name.endswith(("_stderr", "_stderr_window"))
    ]
    lines = []
    if shown:
        lines += ["| metric | value | what it is |", "| --- | --- | --- |"]
        for name in shown:
            value = (
                with_stderr(metrics, name) if metrics[name] is not None else f"— ({nulls.get(name, 'null')})"
            )
            lines.append(f"| {name} | {_cell(value)} | {_cell(described[name])} |")
    if rest:
        lines += [
            "",
            f"<details><summary>{len(rest)} more values</summary>",
            "",
            "| metric | value |",
            "| --- | --- |",
        ]
        lines += [f"| {name} | {_cell(with_stderr(metrics, name))} |" for name in rest]
        lines += ["", "</details>"]
    return lines


def threshold_caveats(results: dict[str, Any]) -> list[str]:
    """Tasks judged by thresholds other than the shipped defaults (which are those a good 4-bit pack is held
    to): said, with where they came from, never implied by a PASS."""
    by_source: dict[str, list[str]] = {}
    for task, entry in results["tasks"].items():
        source = (entry.get("spec") or {}).get("thresholds")
        if entry.get("checks") and source and source != "shipped default":
            by_source.setdefault(source, []).append(task)
    return [
        f"{', '.join(f'`{t}`' for t in tasks)}: judged by the thresholds of {source}, not the shipped "
        "defaults (those a good 4-bit pack is held to)"
        for source, tasks in by_source.items()
    ]


def failed_prompts(results: dict[str, Any]) -> list[str]:
    """One line per smoke prompt the reference answers right and the candidate does not, and per longform
    prompt (in each mode) whose candidate answer or thought loops where the reference's does not or whose
    final answer the candidate gets wrong and the reference right."""
    rows = results["tasks"].get("smoke", {}).get("details") or []
    lines = [
        f"smoke prompt `{row.get('id')}`: the reference's answer passes, the candidate's does not"
        for row in rows
        if row.get("ref_pass") and not row.get("ckpt_pass")
    ]
    for row in results["tasks"].get("longform", {}).get("details") or []:
        name = f"longform prompt `{row.get('id')}`" + (f" ({row['mode']} mode)" if "mode" in row else "")
        for what, key in (("answer", "loop"), ("thought", "thought_loop")):
            if row.get(f"ckpt_{key}") and not row.get(f"ref_{key}"):
                lines.append(f"{name}: the candidate's {what} loops, the reference's does not")
        if row.get("ref_right") and not row.get("ckpt_right"):
            lines.append(f"{name}: the reference's final answer is right, the candidate's is not")
    return lines


# The tasks whose answers are compared as each side decoded them, and what they call the things they ask.
DECODED_ANSWERS = {"smoke": "prompts", "tools": "cases", "longform": "prompts"}


def answer_configuration(entry: dict[str, Any], task: str = "smoke") -> str:
    """How a task's decoded answers (`DECODED_ANSWERS`) were decoded and how often the batch moved them on
    each side, as one sentence (report.md's caveats, the model card): the configuration is part of an
    answer."""
    m = entry.get("metrics", {})
    text = f"`{task}` compares answers {m.get('answers_compared')}"
    ref, ckpt = m.get("ref_batch_sensitive"), m.get("ckpt_batch_sensitive")
    if ref is None or ckpt is None:
        return text + "; whether an answer depends on the batch was not measured: a side decoded one way only"
    text += (
        f"; answers that change when decoded in the spec's batch instead: reference {ref}, candidate {ckpt} "
        f"of {m.get('n_answers', m.get('n_' + DECODED_ANSWERS[task]))}"
    )
    p = m.get("batch_sensitivity_p")
    if isinstance(p, float):
        if p < claims.ALPHA:
            more = "more" if ckpt > ref else "less"
            text += f": the candidate's answers depend on the batch {more} often than the reference's (exact "
        else:
            text += ": not distinguishable from the reference's own (exact "
        text += f"McNemar p = {format_number(p, 2)})"
    return text


def replay_caveats(results: dict[str, Any]) -> list[str]:
    """The caveat of a reference recorded under another execution environment (results.json's `replay`)."""
    replay = results.get("replay")
    return [replay["caveat"]] if isinstance(replay, dict) and replay.get("caveat") else []


def caveats(results: dict[str, Any]) -> list[str]:
    """What the verdict does not say, from results.json alone: default thresholds, failed prompts, the
    text scored, the KLD estimator, what did not run. One sentence per caveat, without the final stop."""
    tasks = results["tasks"]
    notes = difference_caveats(results) + threshold_caveats(results) + failed_prompts(results)
    notes += replay_caveats(results) + baseline_caveats(results)
    for task in DECODED_ANSWERS:
        if tasks.get(task, {}).get("metrics", {}).get("answers_compared"):
            notes.append(answer_configuration(tasks[task], task))
    for task, entry in tasks.items():
        if entry["status"] in ("skipped", "error"):
            what = "was skipped" if entry["status"] == "skipped" else "failed to run"
            notes.append(f"`{task}` {what}: {entry.get('reason', '')}")
    ppl = (
        tasks.get("ppl", {}).get("metrics", {})
        if tasks.get("ppl", {}).get("status") in ("pass", "fail")
        else {}
    )
    if ppl:
        unit = "chat" if "n_chats" in ppl else "window"
        notes.append(
            "± is one standard error: the larger of the per-token one and the one computed from the "
            f"{format_number(ppl.get('n_windows'))} {unit} means, marked (w); with few {unit}s the latter is "
            "itself uncertain by about ±25%"
        )
        notes += calibration_caveats(ppl)
        notes += execution_floor_caveats(tasks["ppl"])
        if ppl.get("corpus") != "wikitext-2-raw-v1":
            notes.append(
                f"the text scored is `{ppl.get('corpus')}`, not WikiText-2: PPL is not comparable with "
                "published figures"
            )
        if ppl.get("kld_estimator") not in (None, "full-vocabulary"):
            notes.append(
                f"KLD is an estimate ({ppl['kld_estimator']}), not the full-vocabulary KL divergence"
            )
        if "lmeval" not in tasks:
            notes.append(
                "a PPL increase is not an accuracy drop: downstream accuracy was not measured (task `lmeval`)"
            )
    return notes


def execution_floor_caveats(ppl: dict[str, Any]) -> list[str]:
    """Where the reference was run again in another execution (`--execution-floor`): its own difference,
    and whether the candidate's lies within it, as the paired test says (within, above or undetermined)."""
    m = ppl.get("metrics", {})
    if "execution_floor" not in m:
        return []
    if m["execution_floor"] is None:
        why = ppl.get("null_reasons", {}).get("execution_floor", "")
        return [f"the reference's own execution difference was not measured: {why}"]
    how = f"its windows {m['execution_floor_windows_per_forward']} at a time"
    if not str(m.get("execution_floor_kernel_setting", "")).startswith("none"):
        how += f", {m['execution_floor_kernel_setting']}"
    kld = format_number(m["execution_floor_kld_mean"])
    own = f"the reference's own execution difference ({how}: mean KLD {kld})"
    low, high = m.get("execution_floor_excess_lower95"), m.get("execution_floor_excess_upper95")
    interval = f"95% bounds of the paired excess [{format_number(low)}, {format_number(high)}]"
    said = {
        "within": f"the candidate's KLD is within {own}: {interval}",
        "above": f"the candidate's KLD exceeds {own}: {interval}",
        "undetermined": f"whether the candidate's KLD is within {own} is undetermined: {interval} hold 0, or "
        "too few windows",
    }
    return [f"`ppl`: {said[m['execution_floor']]}"]


def calibration_caveats(ppl: dict[str, Any]) -> list[str]:
    """What `ppl` found of the calibration set (`--calibration`): the windows (or chats) it holds, and the
    verdict without them; or the data the candidate names that could not be checked."""
    if ppl.get("calibration_note"):
        return [f"calibration data not checked against the scored text: {ppl['calibration_note']}"]
    for unit in ("window", "chat"):
        flagged = ppl.get(f"calibration_flagged_{unit}s")
        if flagged:
            return [
                f"{flagged} {unit}(s) overlap the calibration set (`{ppl.get('calibration_source')}`) above "
                f"{format_number(ppl.get('calibration_flag_share'))} of their tokens: the verdict is "
                f"{ppl.get('verdict_with_flagged')} with them, {ppl.get('verdict_without_flagged')} without "
                "(clean_*)"
            ]
    return []


def _picture(path: str) -> str:
    """An artifact PNG as a picture in a markdown table cell, at thumbnail width (an HTML tag: markdown's own
    image syntax has no size, and a 1344-pixel image would stretch the table past the page)."""
    return f'<img src="{path}" alt="{Path(path).stem}" width="240">'


def _details_tables(details: list[dict[str, Any]], pictures: set[str]) -> list[str]:
    """A task's detail rows as markdown tables: one per value of a row's `table` key (its heading), or one
    table for rows without it. A cell naming one of the task's PNG artifacts is shown as that picture, in its
    row (a case's image beside both answers)."""
    tables: dict[str, list[dict[str, Any]]] = {}
    for row in details:
        tables.setdefault(str(row.get("table", "")), []).append(row)
    lines: list[str] = []
    for title, rows in tables.items():
        columns = [c for c in dict.fromkeys(k for row in rows for k in row) if c != "table"]
        lines += ["", f"### {_cell(title)}", ""] if title else [""]
        lines += ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
        for row in rows:
            cells = [
                _picture(v) if isinstance(v, str) and v in pictures else _cell(v)
                for v in map(row.get, columns)
            ]
            lines.append("| " + " | ".join(cells) + " |")
    return lines


def render_markdown(results: dict[str, Any]) -> str:
    """report.md: the verdict, the summary table, the caveats, then each task: its key metrics with what
    they mean, its rows and its plots."""
    lines = [
        f"# evalsuite report: {results['verdict'].upper()}",
        "",
        f"Candidate {side_label(results['ckpt'])} against reference {side_label(results['ref'])}. "
        "Numbers are shown to 4 significant digits; results.json has them all, with the paths.",
        "",
        *verdict_paragraph(results),
        "| task | metric | ref | ckpt | Δ | threshold | verdict |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    lines += ["| " + " | ".join(_cell(cell) for cell in row) + " |" for row in summary_rows(results)]
    notes = caveats(results)
    if notes:
        lines += ["", "## Caveats", ""] + [f"- {n[:1].upper()}{n[1:]}." for n in notes]
    for task, entry in results["tasks"].items():
        lines += ["", f"## {task}: {entry['status']}", ""]
        if entry.get("reason"):
            lines += [f"{entry['reason']}", ""]
        if entry.get("not_measured"):
            lines += [
                # Nothing to measure in this format (an EXL3 pack's decode), a case skipped here, or a
                # metric left undefined (its null reason below says why).
                f"Not measured here: {', '.join(entry['not_measured'])}.",
                "",
            ]
        lines += _metric_rows(entry)
        details = entry.get("details") or []
        # A picture shown in its detail row is not shown again below.
        pictures = {p for p in entry.get("artifacts", {}).values() if p.endswith(".png")}
        shown = {v for row in details for v in row.values() if isinstance(v, str) and v in pictures}
        lines += _details_tables(details, pictures)
        for name, path in entry.get("artifacts", {}).items():
            if path in shown:
                continue
            lines += ["", f"![{name}]({path})" if path.endswith(".png") else f"- {name}: [{path}]({path})"]
    env = results["environment"]
    lines += [
        "",
        "## Environment",
        "",
        f"- device: {env['device']} ({env['device_name']}), dtype {env['dtype']}",
        *machine_lines(env),
        "- packages: " + ", ".join(f"{k} {v}" for k, v in env["packages"].items() if v),
        "",
    ]
    return "\n".join(lines)


def machine_lines(env: dict[str, Any]) -> list[str]:
    """The report's line on the machine's kernels (CPU model, the ISA torch's and oneDNN's kernels use, any
    override in the environment, the GPU), empty for a results.json written before it was recorded."""
    machine = env.get("machine")
    if not isinstance(machine, dict):
        return []
    cpu = (
        f"- CPU: {machine.get('cpu_model') or 'unknown'}, torch kernels "
        f"{machine.get('torch_cpu_capability')}, oneDNN {machine.get('onednn_isa') or 'unknown'}"
    )
    overrides = machine.get("kernel_overrides") or {}
    if overrides:
        cpu += " (" + ", ".join(f"{k}={v}" for k, v in overrides.items()) + ")"
    gpu = machine.get("gpu")
    if isinstance(gpu, dict):
        cublas = gpu.get("cublas") or "unknown"
        return [cpu, f"- GPU: {gpu.get('name')}, CUDA {gpu.get('cuda')}, cuBLAS {cublas}"]
    return [cpu]


def write_reports(results: dict[str, Any], folder: RunFolder) -> None:
    """Write results.json and report.md, each atomically; both are rendered before either is written, so a
    failure to render leaves neither (never a results.json without its report)."""
    # Strict JSON: TaskResult.to_json writes every non-finite number as null, with its reason.
    document = json.dumps(results, indent=2, allow_nan=False) + "\n"
    markdown = render_markdown(results)
    write_atomic(folder.results_json, document)
    write_atomic(folder.report_md, markdown)


def print_summary(results: dict[str, Any], console: Console) -> None:
    """The summary table on the console: a rich table on a terminal; piped or redirected, plain text rows
    at full width (no wrapping, nothing cut), one per line, for logs and grep."""
    if not console.is_terminal:
        rows = [["task", "metric", "ref", "ckpt", "Δ", "threshold", "verdict"], *summary_rows(results)]
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        console.print(f"evalsuite: {results['verdict'].upper()}", soft_wrap=True, highlight=False)
        for row in rows:
            text = "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
            console.print(text, soft_wrap=True, highlight=False, markup=False)
        return
    table = Table(title=f"evalsuite: {results['verdict'].upper()}")
    for col in ("task", "metric", "ref", "ckpt", "Δ", "threshold", "verdict"):
        table.add_column(col, overflow="fold")
    for row in summary_rows(results):
        style = "red" if row[-1].startswith(("FAIL", "error")) else None
        table.add_row(*row, style=style)
    console.print(table)
