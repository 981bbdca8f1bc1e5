"""The model card's tables of what the run measured beyond WikiText's perplexity
(`evalsuite.reporting.model_card` places them in its Results section): `ppl` on chats split by tag and
turn, the calibration set's overlap with each task's evaluated text, `smoke`'s trajectory survival, `tools`'
tool calls and JSON answers, `longform`'s long answers and `specdec`'s drafting. Every number is read from
results.json."""

from __future__ import annotations

from typing import Any

from evalsuite.reporting.diff_report import answer_configuration, format_number, with_stderr


def measured(entry: dict[str, Any] | None) -> dict[str, Any]:
    """The metrics of a task that ran (pass or fail); empty for one absent, skipped or failed to run."""
    if entry is None or entry.get("status") in ("skipped", "error"):
        return {}
    return entry.get("metrics", {})


def table_row(cells: list[str]) -> str:
    """A markdown table row, each cell's pipes escaped and its line breaks folded."""
    return "| " + " | ".join(c.replace("|", "\\|").replace("\n", " ") for c in cells) + " |"


def chat_splits(results: dict[str, Any]) -> list[str]:
    """`ppl` on chats, split by tag and by assistant turn: each split's mean KLD with its one-sided 95%
    upper bound and same-top rate, errors clustered by chat (too few chats for a bound: none)."""
    m = measured(results["tasks"].get("ppl"))
    names = {k.removesuffix("_kld_mean") for k in m if k.endswith("_kld_mean")}
    splits = sorted(
        (n for n in names if n.startswith(("tag_", "turn_"))), key=lambda n: (not n.startswith("tag_"), n)
    )
    if not splits:
        return []
    lines = [
        "Scored on chats through the model's chat template, assistant tokens only, split by tag and by "
        "assistant turn (errors clustered by chat):",
        "",
        "| split | chats | tokens | mean KLD | KLD 95% upper bound | same top token |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name in splits:
        label = f"tag `{name.removeprefix('tag_')}`" if name.startswith("tag_") else name.replace("_", " ")
        if m.get(f"{name}_note"):  # a split too small to judge: reported, its checks left out of the verdict
            label += f" ({m[f'{name}_note']})"
        lines.append(
            table_row(
                [
                    label,
                    format_number(m.get(f"{name}_n_windows")),
                    format_number(m.get(f"{name}_n_tokens")),
                    format_number(m[f"{name}_kld_mean"]),
                    format_number(m.get(f"{name}_kld_mean_upper95")),
                    format_number(m.get(f"{name}_same_top_p")),
                ]
            )
        )
    return [*lines, ""]


# What each task checks against the calibration set, as the card says it: its units (None: `ppl`'s windows or
# chats) and their tokens that overlap it.
CALIBRATION_UNITS = {
    "ppl": (None, "the scored tokens lie in a {n}-gram it holds"),
    "smoke": (
        "prompts",
        "the `smoke` prompts' tokens lie in a {n}-gram it holds or in a shorter prompt it holds whole",
    ),
    "vision": (
        "cases",
        "the `vision` questions' tokens lie in a {n}-gram it holds or in a shorter question it holds whole",
    ),
}


def calibration_overlap(results: dict[str, Any]) -> list[str]:
    """How much of each task's evaluated text the calibration set holds (`--calibration`: `ppl`'s windows or
    chats, `smoke`'s prompts, `vision`'s questions), which units it overlaps, and the verdict with and
    without them; nothing where no calibration set was given."""
    lines: list[str] = []
    for task, (unit, overlapping) in CALIBRATION_UNITS.items():
        m = measured(results["tasks"].get(task))
        if "calibration_note" in m and f"Calibration set: {m['calibration_note']}." not in lines:
            lines += [f"Calibration set: {m['calibration_note']}.", ""]
        if "calibration_overlap_share" not in m:
            continue
        unit = unit or ("chats" if "calibration_flagged_chats" in m else "windows")
        flagged = m.get(f"calibration_flagged_{unit}", 0)
        share = format_number(m["calibration_overlap_share"])
        bound = format_number(m.get("calibration_flag_share"))
        counted = f"1 {unit.removesuffix('s')} overlaps" if flagged == 1 else f"{flagged} {unit} overlap"
        text = (
            f"Calibration set `{m.get('calibration_source')}`: {share} of "
            f"{overlapping.format(n=m.get('calibration_ngram'))}; {counted} it by more than {bound}"
        )
        names = str(m.get(f"calibration_flagged_{unit.removesuffix('s')}_list") or "")
        if task != "ppl" and names:  # ppl's units are indices; a prompt or case has a name
            text += ": " + ", ".join(f"`{name}`" for name in names.split(","))
        if "verdict_without_flagged" in m:
            verdicts = m["verdict_with_flagged"], m["verdict_without_flagged"]
            text += " (verdict with them: {}, without them: {})".format(*verdicts)
        elif "clean_note" in m:
            text += f" ({m['clean_note']})"
        lines += [text + ".", ""]
    return lines


def greedy_answers(results: dict[str, Any]) -> list[str]:
    """How long the two sides' greedy answers agree (`smoke`'s trajectory survival), with its intervals."""
    m = measured(results["tasks"].get("smoke"))
    lengths = sorted(int(k.removeprefix("survival_")) for k in m if k.removeprefix("survival_").isdigit())
    if not lengths:
        return []
    lines = [
        f"Greedy answers to {format_number(m.get('n_prompts'))} prompts (`smoke`): the share whose two "
        "answers agree for their first N tokens (trajectory survival), with a 95% Wilson interval over "
        "prompts:",
        "",
        "| N | survival | 95% interval | prompts |",
        "| --- | --- | --- | --- |",
    ]
    for n in lengths:
        low, high = m.get(f"survival_{n}_lower95"), m.get(f"survival_{n}_upper95")
        lines.append(
            table_row(
                [
                    str(n),
                    format_number(m[f"survival_{n}"]),
                    f"[{format_number(low)}, {format_number(high)}]",
                    format_number(m.get(f"survival_{n}_n")),
                ]
            )
        )
    lines += [
        "",
        f"- answered identically: {format_number(m.get('identical'))}; the reference's answer right and the "
        f"candidate's wrong: {format_number(m.get('ref_pass_ckpt_fail'))}; parting on a token outside the "
        f"reference's top-5: {format_number(m.get('diverged_outside_top5'))}; on a near tie (the reference's "
        f"own preference below the spec's `near_tie` at that step): {format_number(m.get('near_ties'))}",
        f"- {answer_configuration(results['tasks']['smoke'])}",
        "- every answer is as its side decoded it; at N, only the prompts whose token budget reaches N are "
        "counted",
    ]
    if "kld_mean" in m:
        lines.append(
            f"- KLD along the reference's answers: {with_stderr(m, 'kld_mean')} over "
            f"{format_number(m.get('answer_tokens'))} tokens "
            f"({m.get('kld_estimator', 'estimator not stated')})"
        )
    return [*lines, ""]


def tool_calls(results: dict[str, Any]) -> list[str]:
    """`tools`: each side's share of cases whose answer holds a JSON object, is valid under the case's
    schema and is the expected call, with 95% Wilson intervals over cases; the drop with Newcombe's paired
    interval and the flips' McNemar p."""
    m = measured(results["tasks"].get("tools"))
    if "parse_rate_ref" not in m:
        return []

    def interval(name: str) -> str:
        return f"[{format_number(m.get(f'{name}_lower95'))}, {format_number(m.get(f'{name}_upper95'))}]"

    lines = [
        f"Tool calls and JSON answers to {format_number(m.get('n_cases'))} cases (`tools`; "
        f"{format_number(m.get('n_through_template'))} asked through the chat template's tools, "
        f"{format_number(m.get('n_json_mode'))} in JSON mode): each side's share of cases, with a 95% Wilson "
        "interval over cases; the drop (reference − candidate) with Newcombe's paired 95% interval:",
        "",
        "| outcome | reference | candidate | drop | lost / gained (McNemar p) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for outcome, words in (
        ("parse", "parsed"),
        ("schema_valid", "schema-valid"),
        ("right_call", "right call"),
    ):
        ref, ckpt, drop = (f"{outcome}_rate_{s}" for s in ("ref", "ckpt", "drop"))
        flips = f"{format_number(m.get(f'{outcome}_lost'))} / {format_number(m.get(f'{outcome}_gained'))}"
        cells = [f"{format_number(m.get(name))} {interval(name)}" for name in (ref, ckpt, drop)]
        lines.append(table_row([words, *cells, f"{flips} (p = {format_number(m.get(f'{outcome}_flip_p'))})"]))
    lines += ["", f"- {answer_configuration(results['tasks']['tools'], 'tools')}", ""]
    return lines


# `longform`'s outcomes on the card, one row each: what, the metric of each side's count, those of the
# prompts where only the candidate or only the reference has it, the exact McNemar p, and the sample.
LONG_ANSWER_ROWS = (
    (
        "answers ending in a loop (last 64 tokens periodic, period ≤ 32)",
        "loops_ref",
        "loops_ckpt",
        "ckpt_loops_not_ref",
        "ref_loops_not_ckpt",
        "loop_flips_p",
        "n_prompts",
    ),
    (
        "thoughts ending in a loop",
        "thought_loops_ref",
        "thought_loops_ckpt",
        "ckpt_thought_loops_not_ref",
        "ref_thought_loops_not_ckpt",
        "thought_loop_flips_p",
        "n_prompts",
    ),
    (
        "answers cut by the token budget (no EOS)",
        "budget_stops_ref",
        "budget_stops_ckpt",
        "ckpt_budget_stops_not_ref",
        "ref_budget_stops_not_ckpt",
        "budget_stop_flips_p",
        "n_prompts",
    ),
    (
        "final answers right (`expect`)",
        "right_ref",
        "right_ckpt",
        "right_gained",
        "right_lost",
        "right_flips_p",
        "n_prompts",
    ),
    (
        "answers not in the prompt's language (of those with letters)",
        "off_language_ref",
        "off_language_ckpt",
        "language_lost",
        "language_gained",
        "language_flips_p",
        "language_n",
    ),
    (
        "answers holding U+FFFD or invalid UTF-8",
        "invalid_text_ref",
        "invalid_text_ckpt",
        "ckpt_invalid_text_not_ref",
        "ref_invalid_text_not_ckpt",
        "invalid_text_flips_p",
        "n_prompts",
    ),
)


def _share(m: dict[str, Any], count: str, sample: str) -> str:
    """A count of prompts with its share's 95% Wilson interval, as results.json gives them: `3 of 66 [0.016,
    0.13]`."""
    k, n = m.get(count), m.get(sample)
    if not isinstance(k, int) or not isinstance(n, int) or not n:
        return "—"
    low, high = (format_number(m.get(f"{count}_share_{end}"), 2) for end in ("lower95", "upper95"))
    return f"{k} of {n} [{low}, {high}]"


def long_answers(results: dict[str, Any]) -> list[str]:
    """`longform`'s long answers: per outcome each side's count with its 95% interval, the prompts where only
    one side has it and the exact McNemar p, per mode; the paired length ratio with its interval."""
    entry = results["tasks"].get("longform")
    m = measured(entry)
    if not m:
        return []
    assert entry is not None
    lines = [
        f"Long greedy answers to {format_number(m.get('n_prompts'))} prompts (`longform`): counts of prompts "
        "with the 95% Wilson interval of their share, the prompts where only one side has the outcome, and "
        "the exact McNemar p of the two (paired over prompts):",
        "",
    ]
    modes = [("", "")] + ([("thinking_", " (thinking mode)")] if "thinking_n_prompts" in m else [])
    for prefix, label in modes:
        lines += [
            f"| outcome{label} | reference | candidate | candidate only | reference only | McNemar p |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        for what, ref, ckpt, ckpt_only, ref_only, p, sample in LONG_ANSWER_ROWS:
            if f"{prefix}{ref}" not in m or m[f"{prefix}{ref}"] is None:
                continue
            cells = [_share(m, f"{prefix}{ref}", f"{prefix}{sample}")]
            cells += [_share(m, f"{prefix}{ckpt}", f"{prefix}{sample}")]
            cells += [format_number(m.get(f"{prefix}{k}")) for k in (ckpt_only, ref_only)]
            lines.append(table_row([what, *cells, format_number(m.get(f"{prefix}{p}"), 2)]))
        lines += ["", *_long_answer_notes(entry, prefix, label), ""]
    lines += [f"- {answer_configuration(entry, 'longform')}", f"- modes: {m.get('thinking_modes')}", ""]
    return lines


def _long_answer_notes(entry: dict[str, Any], prefix: str, label: str) -> list[str]:
    """Below a mode's table: the answers' lengths and their paired ratio with its interval, whether right
    answers are shown lost (or why that is undetermined), and the thoughts' lengths in a thinking mode."""
    m = entry["metrics"]

    def figure(name: str) -> str:
        return format_number(m.get(f"{prefix}{name}"))

    lost = m.get(f"{prefix}right_lost_shown")
    reason = (entry.get("null_reasons") or {}).get(f"{prefix}right_lost_shown", "not reported")
    notes = [
        f"- answer length{label}: reference {with_stderr(m, f'{prefix}length_mean_ref')}, candidate "
        f"{with_stderr(m, f'{prefix}length_mean_ckpt')} tokens; ratio {figure('length_ratio')} (95% interval "
        f"[{figure('length_ratio_lower95')}, {figure('length_ratio_upper95')}], paired log-ratio over "
        f"{figure('length_ratio_n')} prompts)",
        "- right answers lost more often than gained (exact McNemar, p < 0.05): "
        + (("shown" if lost else "not shown") if isinstance(lost, bool) else reason),
    ]
    if f"{prefix}thought_tokens_mean_ref" in m:
        notes.append(
            f"- thought length: reference {with_stderr(m, f'{prefix}thought_tokens_mean_ref')}, candidate "
            f"{with_stderr(m, f'{prefix}thought_tokens_mean_ckpt')} tokens; thoughts never closed: reference "
            f"{figure('thought_unclosed_ref')}, candidate {figure('thought_unclosed_ckpt')}"
        )
    return notes


def _mean_and_interval(m: dict[str, Any], name: str) -> str:
    """A mean over prompts with its 95% interval, or why it has none."""
    low, high = m.get(f"{name}_lower95"), m.get(f"{name}_upper95")
    if low is None or high is None:
        return f"{format_number(m.get(name))} (too few prompts for an interval)"
    return f"{format_number(m.get(name))} [{format_number(low)}, {format_number(high)}]"


def speculative_decoding(results: dict[str, Any]) -> list[str]:
    """`specdec`: whether drafting left each side's greedy answers as they were, and each side's mean accepted
    length per workload with its interval over prompts, the candidate's paired against the reference's."""
    m = measured(results["tasks"].get("specdec"))
    if "n_prompts" not in m:
        return []
    lines = [
        f"Speculative decoding (`specdec`; drafting: {m.get('drafting')}): each side decoded "
        f"{format_number(m['n_prompts'])} prompts greedily, each alone, plainly and with drafting. Drafting "
        f"changed {format_number(m.get('ref_drafting_changed'))} of the reference's "
        f"{format_number(m['n_prompts'])} answers ({format_number(m.get('ref_drafting_near_ties'))} at a "
        f"near tie) and {format_number(m.get('ckpt_drafting_changed'))} of the candidate's "
        f"({format_number(m.get('ckpt_drafting_near_ties'))} at a near tie); lossless: reference "
        f"{format_number(m.get('ref_lossless'))}, candidate {format_number(m.get('ckpt_lossless'))}.",
        "",
        "| workload | prompts | reference: accepted length [95% interval] | candidate: accepted length | "
        "candidate − reference, paired | candidate | rounds (ref / ckpt) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    # The workloads the run had prompts of, in the spec's order (the order `specdec` wrote them in).
    names = [k.removeprefix("n_prompts_") for k in m if k.startswith("n_prompts_")]
    workloads = [(w, f"_{w}", f"n_prompts_{w}") for w in names]
    for label, suffix, count in [*workloads, ("all", "_mean", "n_prompts")]:
        diff = "accept_diff" + suffix
        rounds = (
            ("ref_rounds", "ckpt_rounds")
            if label == "all"
            else (f"ref_rounds{suffix}", f"ckpt_rounds{suffix}")
        )
        lines.append(
            table_row(
                [
                    label.replace("_", " "),
                    format_number(m.get(count)),
                    _mean_and_interval(m, f"ref_accept{suffix}"),
                    _mean_and_interval(m, f"ckpt_accept{suffix}"),
                    _mean_and_interval(m, diff),
                    str(m.get(f"{diff}_direction", "undetermined")),
                    f"{format_number(m.get(rounds[0]))} / {format_number(m.get(rounds[1]))}",
                ]
            )
        )
    lines += [
        "",
        "- accepted length: new tokens per verification round (one forward of the side's own model), the "
        "bonus token included; its mean over prompts, each prompt one unit, with a Student-t 95% interval; "
        "the difference is paired over prompts, and called higher or lower only where its interval excludes "
        "0 (undetermined otherwise, or with fewer than 3 prompts)",
        "- each side drafts for itself alone (batch 1), and its answers drafted are compared with its own "
        "plain greedy answers, decoded alone",
    ]
    if m.get("ckpt_speedup") is not None:
        lines.append(
            f"- on the GPU: reference {_mean_and_interval(m, 'ref_speedup')}× faster drafted, candidate "
            f"{_mean_and_interval(m, 'ckpt_speedup')}× (plain time over drafted time, mean over prompts)"
        )
    else:
        lines.append("- tokens per second: not measured (they are, only where a GPU runs the side)")
    return [*lines, ""]
