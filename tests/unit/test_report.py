"""report.md and the console table, rendered from results.json alone: readable by a publisher."""

from __future__ import annotations

import io

from rich.console import Console

from evalsuite.reporting.diff_report import print_summary, render_markdown, summary_rows
from evalsuite.reporting.model_card import render_model_card
from tests.documents import ppl_task, results_document


def with_spec(entry: dict, thresholds: str) -> dict:
    return {**entry, "spec": {"file": "tasks/ppl.toml", "thresholds": thresholds}}


def test_report_names_the_sides_not_their_local_paths():
    report = render_markdown(results_document())
    assert "`MiniCPM-V-4.7-W4A8` (compressed-tensors)" in report
    assert "/packs/MiniCPM-V-4.7-W4A8" not in report


def test_metrics_are_shown_to_four_digits_with_what_they_mean():
    entry = ppl_task()
    entry["descriptions"] = {"ppl_ratio": "ppl_ckpt / ppl_ref", "kld_mean": "mean KL(ref ‖ ckpt)"}
    report = render_markdown(results_document(ppl=entry))
    assert "| ppl_ratio | 1.815 | ppl_ckpt / ppl_ref |" in report
    assert "1.81514" not in report.split("## ppl")[1].split("<details>")[0]
    # The rest are folded away, not lost.
    assert "<details><summary>" in report and "| kld_p999 |" in report


def test_thresholds_other_than_the_shipped_defaults_are_said_with_their_source():
    own = render_markdown(results_document(ppl=with_spec(ppl_task(), "--thresholds demo-thresholds.toml")))
    assert "`ppl`: judged by the thresholds of --thresholds demo-thresholds.toml, not the shipped" in own
    shipped = render_markdown(results_document(ppl=with_spec(ppl_task(), "shipped default")))
    assert "judged by the thresholds of" not in shipped


def test_a_baseline_check_shows_the_value_it_compared():
    entry = ppl_task()
    entry["checks"].append(
        {"name": "kld_mean_vs_baseline", "value": 0.4528, "op": "<=", "threshold": 0.38, "passed": False}
    )
    row = next(r for r in summary_rows(results_document(ppl=entry)) if r[1] == "kld_mean_vs_baseline")
    assert row[3] == "0.4528" and row[-1] == "FAIL"


def test_a_null_metric_shows_its_reason():
    entry = ppl_task()
    entry["metrics"]["kld_p999"] = None
    entry["descriptions"] = {"kld_p999": "99.9th percentile"}
    entry["null_reasons"] = {"kld_p999": "fewer than 1000 tokens"}
    assert "| kld_p999 | — (fewer than 1000 tokens) | 99.9th percentile |" in render_markdown(
        results_document(ppl=entry)
    )


def test_a_failed_smoke_prompt_is_named_in_the_report_and_the_card():
    smoke = {
        "status": "fail",
        "metrics": {"n_prompts": 2, "ref_pass_ckpt_fail": 1},
        "checks": [{"name": "ref_pass_ckpt_fail", "value": 1, "op": "<=", "threshold": 0, "passed": False}],
        "artifacts": {},
        "details": [
            {"id": "largest-planet", "ref_pass": True, "ckpt_pass": False},
            {"id": "capital-france", "ref_pass": True, "ckpt_pass": True},
        ],
    }
    results = results_document(ppl=ppl_task(), smoke=smoke)
    for text in (render_markdown(results), render_model_card(results)):
        assert "smoke prompt `largest-planet`" in text.lower() and "`capital-france`" not in text


def test_piped_console_output_is_whole_lines():
    entry = ppl_task()
    entry["checks"].append(
        {"name": "kld_mean_vs_baseline", "value": 0.4528, "op": "<=", "threshold": 0.38, "passed": False}
    )
    buffer = io.StringIO()
    print_summary(results_document(ppl=entry), Console(file=buffer, width=80, force_terminal=False))
    lines = buffer.getvalue().splitlines()
    row = next(line for line in lines if "kld_mean_vs_baseline" in line)
    assert "kld_mean_vs_baseline <= 0.38" in row and row.rstrip().endswith("FAIL")
    assert not any(set(line) & set("┃│━") for line in lines)  # no box drawing to fold at 80 columns
