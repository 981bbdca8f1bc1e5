"""Reports rendered from results.json alone: results.json itself, report.md (the diff) and the console table.

Rendering needs nothing but the results document, so a run can be re-rendered later, anywhere.
"""

from __future__ import annotations

import json
import math
from typing import Any

from rich.console import Console
from rich.table import Table

from evalsuite.run_folder import RunFolder, write_atomic


def format_number(value: Any) -> str:
    """A metric for people: 6 significant digits, ints and strings as they are."""
    if isinstance(value, bool) or value is None:
        return "—" if value is None else str(value).lower()
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return f"{value:.6g}"
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
            rows.append([task, name, "", with_stderr(m, name), "", _threshold(check), _verdict(check)])
    return rows


def _threshold(check: dict[str, Any] | None) -> str:
    return "" if check is None else f"{check['name']} {check['op']} {format_number(check['threshold'])}"


def _verdict(check: dict[str, Any] | None) -> str:
    return "" if check is None else ("pass" if check["passed"] else "FAIL")


def _cell(value: Any) -> str:
    """A value as one markdown table cell: pipes escaped, newlines as <br>."""
    text = "" if value is None else format_number(value)
    text = text.replace("|", "\\|").replace("\r", "").replace("\n", "<br>")
    # Generated text can hold control characters (a random model's bytes): show them, never emit them.
    return "".join(ch if ch.isprintable() else f"\\x{ord(ch):02x}" for ch in text)


def _details_tables(details: list[dict[str, Any]]) -> list[str]:
    """A task's detail rows as markdown tables: one per value of a row's `table` key (its heading), or one
    table for rows without it."""
    tables: dict[str, list[dict[str, Any]]] = {}
    for row in details:
        tables.setdefault(str(row.get("table", "")), []).append(row)
    lines: list[str] = []
    for title, rows in tables.items():
        columns = [c for c in dict.fromkeys(k for row in rows for k in row) if c != "table"]
        lines += ["", f"### {_cell(title)}", ""] if title else [""]
        lines += ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
        lines += ["| " + " | ".join(_cell(row.get(c)) for c in columns) + " |" for row in rows]
    return lines


def render_markdown(results: dict[str, Any]) -> str:
    """report.md: the verdict, the summary table, then every metric of every task."""
    lines = [
        f"# evalsuite report: {results['verdict'].upper()}",
        "",
        f"- candidate (`--ckpt`): `{results['ckpt']['path']}` ({results['ckpt']['format']})",
        f"- reference (`--ref`): `{results['ref']['path']}` ({results['ref']['format']})",
        "",
        "| task | metric | ref | ckpt | Δ | threshold | verdict |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    lines += [
        "| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in summary_rows(results)
    ]
    for task, entry in results["tasks"].items():
        lines += ["", f"## {task}: {entry['status']}", ""]
        if entry.get("reason"):
            lines += [f"{entry['reason']}", ""]
        metrics = entry.get("metrics", {})
        if metrics:
            lines += ["| metric | value |", "| --- | --- |"]
            lines += [f"| {name} | {format_number(value)} |" for name, value in metrics.items()]
        lines += _details_tables(entry.get("details") or [])
        for name, path in entry.get("artifacts", {}).items():
            lines += ["", f"![{name}]({path})" if path.endswith(".png") else f"- {name}: [{path}]({path})"]
    env = results["environment"]
    lines += [
        "",
        "## Environment",
        "",
        f"- device: {env['device']} ({env['device_name']}), dtype {env['dtype']}",
        "- packages: " + ", ".join(f"{k} {v}" for k, v in env["packages"].items() if v),
        "",
    ]
    return "\n".join(lines)


def write_reports(results: dict[str, Any], folder: RunFolder) -> None:
    """Write results.json and report.md, each atomically."""
    # Strict JSON: TaskResult.to_json writes every non-finite number as null, with its reason.
    write_atomic(folder.results_json, json.dumps(results, indent=2, allow_nan=False) + "\n")
    write_atomic(folder.report_md, render_markdown(results))


def print_summary(results: dict[str, Any], console: Console) -> None:
    """The summary table on the console."""
    table = Table(title=f"evalsuite: {results['verdict'].upper()}")
    for col in ("task", "metric", "ref", "ckpt", "Δ", "threshold", "verdict"):
        table.add_column(col, overflow="fold")
    for row in summary_rows(results):
        style = "red" if row[-1].startswith(("FAIL", "error")) else None
        table.add_row(*row, style=style)
    console.print(table)
