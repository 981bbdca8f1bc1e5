"""What a verdict stands beside: every paired difference from the reference that is significant after Holm's
correction over all the run tested is named in the verdict's paragraph and the caveats of report.md and the
model card, whether or not a check covers it; a baseline's metric measured otherwise is not compared; a check
on a metric measured on part of the text says which part; and no report names a file by this machine's
absolute path."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from evalsuite.contract.results import load_results, not_comparable
from evalsuite.pipeline.plan import RunRequest, build_tasks, spec_provenance
from evalsuite.pipeline.runner import with_holm
from evalsuite.protocol.task import Difference, RunContext, TaskResult
from evalsuite.reporting.diff_report import render_markdown, significant_differences
from evalsuite.reporting.model_card import render_model_card
from tests.documents import ppl_task, results_document
from tests.unit.test_model_card import caveats, numbers_not_in

GEN = "evalsuite-mini-gen.exact_match"


def lmeval_task(p_gen: float = 0.0078125) -> dict[str, Any]:
    """An lmeval entry like the committed example's: `evalsuite-mini.acc` checked and no worse, the
    generation task 0.6 → 0.2 with no check on it."""
    return {
        "status": "pass",
        "metrics": {"evalsuite-mini.acc.n": 100, f"{GEN}.n": 20, f"{GEN}.ref": 0.6, f"{GEN}.ckpt": 0.2},
        "checks": [
            {
                "name": "evalsuite-mini.acc.recovery",
                "value": 0.86,
                "op": ">=",
                "threshold": 0.75,
                "passed": True,
            }
        ],
        "differences": [
            difference("`evalsuite-mini.acc`", 0.3593, "evalsuite-mini.acc"),
            difference(f"`{GEN}`", p_gen, GEN, said="0.6 → 0.2, 8 documents correct → wrong against 0"),
        ],
        "artifacts": {},
    }


def difference(name: str, p: float, prefix: str, said: str = "0.37 → 0.32") -> dict[str, Any]:
    metrics = [f"{prefix}.{stat}" for stat in ("delta", "recovery", "mcnemar_p")]
    return Difference(
        name, said, "McNemar's exact test of the flips, two-sided", p, True, tuple(metrics)
    ).to_json()


def example() -> dict[str, Any]:
    ppl = ppl_task()
    ppl["differences"] = [
        Difference(
            "PPL", "11.61 → 21.08 (ratio 1.815)", "paired t", 1e-9, True, ("ln_ppl_ratio", "ppl_ratio")
        ).to_json()
    ]
    doc = results_document(ppl=ppl, lmeval=lmeval_task())
    doc["verdict"] = "pass"
    return doc


def verdict_paragraph(card: str) -> str:
    return card.split("## Validation against the reference")[1].split("### Protocol")[0]


def test_a_significant_drop_no_check_covers_is_named_beside_the_verdict_and_in_the_caveats():
    doc = example()
    card, report = render_model_card(doc), render_markdown(doc)
    head = verdict_paragraph(card)
    assert "Verdict: **PASS**" in head
    said = f"`{GEN}` (lmeval): 0.6 → 0.2, 8 documents correct → wrong against 0, the candidate worse"
    assert said in head and "which no check covers" in head
    assert "PPL (ppl): 11.61 → 21.08 (ratio 1.815)" in head and "checked by `ppl_ratio`" in head
    assert "`evalsuite-mini.acc`" not in head  # p = 0.36: no difference shown
    assert said in caveats(card)
    assert said in report.split("## Caveats")[0] and said in report.split("## Caveats")[1]
    # The Holm-adjusted p is results.json's, or adjusted from its p where it is not there.
    shown, tested = significant_differences(doc)
    assert tested == 3 and [d["p_holm"] for d in shown] == pytest.approx([3e-9, 0.0078125 * 2])


def test_a_difference_significant_alone_but_not_after_holm_is_not_named():
    # Built to fail a rule on the unadjusted p: 0.03 < 0.05, but Holm over three gives 0.06.
    doc = results_document(lmeval=lmeval_task(p_gen=0.03))
    doc["tasks"]["lmeval"]["differences"].append(difference("`other`", 0.04, "other"))
    card = render_model_card(doc)
    # Not a difference the data show; said undetermined (unchecked, on the worse side), never shown.
    differences, undetermined = verdict_paragraph(card).split("Undetermined beside the verdict")
    assert f"`{GEN}`" not in differences and f"`{GEN}`" in undetermined
    assert "No difference from the reference is significant after Holm's correction" in verdict_paragraph(
        card
    )
    assert significant_differences(doc)[0] == []


def test_the_runner_adjusts_every_difference_of_the_run_together():
    results = {
        "ppl": TaskResult("pass", differences=[Difference("PPL", "", "t", 0.01, True, ())]),
        "lmeval": TaskResult(
            "pass",
            differences=[Difference("a", "", "t", 0.02, True, ()), Difference("b", "", "t", 0.5, True, ())],
        ),
    }
    with_holm(results)
    adjusted = [d.p_holm for r in results.values() for d in r.differences]
    assert adjusted == pytest.approx([0.03, 0.04, 0.5])


def test_every_number_of_the_verdict_paragraph_is_a_value_of_results_json():
    doc = example()
    shown, _ = significant_differences(doc)
    for task in ("ppl", "lmeval"):  # as the runner writes them: each with its Holm-adjusted p
        for d in doc["tasks"][task]["differences"]:
            d["p_holm"] = next((s["p_holm"] for s in shown if s["name"] == d["name"]), 1.0)
    assert numbers_not_in(doc, render_model_card(doc)) == []


def test_a_results_json_with_identity_and_differences_reads_back_typed(tmp_path):
    doc = example()
    doc["tasks"]["lmeval"]["identity"] = {"spec_sha256": "ab" * 32, "samples": {}, "metric_samples": {}}
    doc["tasks"]["lmeval"]["not_comparable"] = {
        f"{GEN}.delta": "the baseline does not record what it measured"
    }
    (tmp_path / "results.json").write_text(json.dumps(doc))
    typed = load_results(tmp_path / "results.json")
    assert typed.tasks["lmeval"].differences[1].said.startswith("0.6 → 0.2")
    assert typed.tasks["lmeval"].identity is not None and typed.tasks["lmeval"].not_comparable


FED = {"windows": [0, 7], "tokens": 1024, "words": "on the fed windows 0, 7 of 8: 1,024 tokens per MoE layer"}
EVERY = {
    "windows": list(range(8)),
    "tokens": 4096,
    "words": "on every window (8): 4,096 tokens per MoE layer",
}


def moe_identity(spec: str, fed: dict[str, Any]) -> dict[str, Any]:
    return {
        "spec_sha256": spec,
        "samples": {"every": EVERY, "fed": fed},
        "metric_samples": {"mean_topk_overlap": "fed"},
    }


def test_a_baseline_metric_is_compared_only_under_the_same_identity():
    run = moe_identity("a" * 64, FED)
    assert not_comparable("mean_topk_overlap", moe_identity("a" * 64, FED), run) is None
    fed8 = {**EVERY, "words": "on the fed windows 0, 1, 2, 3, 4, 5, 6, 7 of 8: 4,096 tokens per MoE layer"}
    why = not_comparable("mean_topk_overlap", moe_identity("b" * 64, fed8), run)
    assert why == (
        f"the baseline measured it {fed8['words']}, this run on the fed windows 0, 7 of 8: 1,024 tokens per "
        "MoE layer, under another spec"
    )
    # a metric measured on every window: the same windows, another spec
    assert "under another spec" in str(
        not_comparable("own_mean_topk_overlap", moe_identity("b" * 64, fed8), run)
    )
    assert "does not record" in str(not_comparable("mean_topk_overlap", None, run))


def test_a_check_on_a_fed_metric_and_a_metric_not_compared_are_said_in_report_and_card():
    moe = {
        "status": "pass",
        "metrics": {"mean_topk_overlap": 0.98},
        "checks": [
            {"name": "mean_topk_overlap", "value": 0.98, "op": ">=", "threshold": 0.8, "passed": True}
        ],
        "identity": moe_identity("a" * 64, FED),
        "not_comparable": {"worst_expert_rel_err": "the baseline measured it on another sample"},
        "artifacts": {},
    }
    doc = results_document(moe=moe)
    for text in (render_model_card(doc), render_markdown(doc)):
        assert f"mean_topk_overlap ({FED['words']})" in text
        assert "`moe.worst_expert_rel_err` was not compared with the baseline" in text
        assert "worst_expert_rel_err_vs_baseline" in text and "not comparable" in text


def test_a_thresholds_file_is_named_relative_to_the_project_never_by_its_absolute_path(tmp_path, monkeypatch):
    project = tmp_path / "project"
    (project / "tasks").mkdir(parents=True)
    thresholds = project / "tasks" / "demo-thresholds.toml"
    thresholds.write_text("[ppl]\nppl_ratio = { max = 1.7 }\n")
    monkeypatch.chdir(project)
    request = RunRequest(
        ckpt="c", ref="r", tasks=["ppl"], out=project / "reports" / "run",
        thresholds={"ppl": {"ppl_ratio": {"max": 1.7}}}, thresholds_file=thresholds.resolve(),
    )  # fmt: skip
    (task,) = build_tasks(["ppl"], RunContext())
    said = spec_provenance(task, request)["thresholds"]
    assert said == "--thresholds tasks/demo-thresholds.toml"
    doc = results_document(ppl={**ppl_task(), "spec": {"thresholds": said}})
    assert str(project) not in render_model_card(doc) and "tasks/demo-thresholds.toml" in render_model_card(
        doc
    )
    assert Path(said.split()[-1]).is_absolute() is False


def test_an_unchecked_drop_the_data_do_not_decide_is_said_undetermined_beside_the_verdict():
    # The regenerated example on another CPU: the generation task 0.6 → 0.35, McNemar p = 0.125.
    doc = results_document(lmeval=lmeval_task(p_gen=0.125))
    head = verdict_paragraph(render_model_card(doc))
    assert "No difference from the reference is significant after Holm's correction" in head
    assert "Undetermined beside the verdict" in head
    assert f"`{GEN}` (lmeval): 0.6 → 0.2, 8 documents correct → wrong against 0" in head
    assert "p = 0.12, Holm p = 0.25" in head
    # A drop a check covers is the check's to judge; a significant one is a difference, not undetermined.
    assert "`evalsuite-mini.acc`" not in head.split("Undetermined")[1]
    assert "Undetermined" not in verdict_paragraph(render_model_card(example()))


def test_a_worse_figure_whose_p_cannot_be_computed_is_said_undetermined_beside_a_pass():
    # Two windows: the window-clustered t has too few clusters for a p (`claims.MIN_CLUSTERS`), so the
    # candidate's lower probability of the true token, which no check covers, is neither shown nor cleared.
    metrics = {"n_windows": 2, "ln_ppl_ratio_stderr_window": 0.01, "delta_p_mean_stderr_window": 0.002}
    ppl = ppl_task(**metrics)
    ppl["status"], ppl["checks"][0]["passed"] = "pass", True
    (task,) = build_tasks(["ppl"], RunContext())
    found = task.paired_differences(ppl["metrics"])
    assert [d.worse for d in found] == [True, True] and all(d.to_json()["p"] is None for d in found)
    ppl["differences"] = [d.to_json() for d in found]
    doc = results_document(ppl=ppl)
    doc["verdict"] = "pass"
    for head in (verdict_paragraph(render_model_card(doc)), render_markdown(doc).split("| task |")[0]):
        assert "Undetermined beside the verdict" in head
        undetermined = head.split("Undetermined beside the verdict")[1]
        said = "the true token's probability (ppl): mean Δp -0.07974 (paired by token, window-clustered t"
        assert said in undetermined
        assert "p cannot be computed: 2 windows, a paired test needs at least 3" in undetermined
        assert "PPL (ppl)" not in undetermined  # checked by `ppl_ratio`: the check's to judge
