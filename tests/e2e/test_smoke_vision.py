"""Tasks `smoke` and `vision` through the CLI: live runs, replays against recordings, refusals."""

from __future__ import annotations

import json

import pytest

from evalsuite.contract.spec import default_spec_path, load_spec
from evalsuite.tasks.answer_pairs import DIVERGENCE_MARK
from evalsuite.tasks.smoke import SmokeSpec
from tests.conftest import (
    TINY_SMOKE_PROMPTS,
    cli_in_process,
    cli_run_in_process,
    rerun,
    tiny_spec_args,
    wrong_scale_copy,
)


def task_result(run_dir, name):
    return json.loads((run_dir / "results.json").read_text())["tasks"][name]


def test_random_tiny_model_fails_the_answer_check_and_says_so(tiny_run):
    vision = tiny_run.task("vision")
    assert vision["status"] == "fail"
    failed = {c["name"] for c in vision["checks"] if not c["passed"]}
    assert failed == {"ref_pass", "ckpt_pass"}  # a random model names no shapes; parity still holds
    report = (tiny_run.out / "report.md").read_text()
    assert "## vision: fail" in report and "ref_pass" in report


def test_w4a8_copy_keeps_the_vision_tower_exactly(tiny_run):
    m = tiny_run.metrics("vision")
    assert m["vision_cosine"] == 1.0 and m["vision_rel_err"] == 0.0 and m["vision_max_abs"] == 0.0
    assert m["processing"].startswith(("processor", "image processor"))
    assert len(m["image_sha256"]) == 64 and (tiny_run.out / "artifacts" / "vision_image.png").is_file()


def test_replay_gives_the_live_results_for_smoke_and_vision(tiny_run, tiny_replay):
    assert tiny_replay.cli.returncode == 1, tiny_replay.cli.stderr  # the same verdict, nothing loaded
    assert tiny_replay.loads == []
    for name in ("smoke", "vision"):
        live, again = tiny_run.task(name), tiny_replay.task(name)
        assert again["metrics"] == live["metrics"], name
        assert again.get("details") == live.get("details"), name


def test_a_baseline_keeps_every_detail_row(tiny_pair, tiny_run, tmp_path):
    """--baseline adds regression checks and keeps what the run found: every smoke row stays in results.json
    and report.md (the observations are reused: no model is loaded)."""
    args = ("run", "--ckpt", tiny_pair["tiny-minicpmv47-w4a8"], "--ref", tiny_pair["tiny-minicpmv47-bf16"])
    args += (
        "--tasks",
        "smoke,vision",
        *tiny_spec_args(),
        "--corpus",
        "python-docs",
        "--baseline",
        tiny_run.out / "results.json",
    )
    again = rerun(tiny_run, tmp_path / "again", *args)
    # Vision's answer checks still fail; the baseline adds none that fail.
    assert again.cli.returncode == 1, again.cli.stderr
    assert again.loads == []
    assert len(again.task("smoke")["details"]) == len(tiny_run.task("smoke")["details"]) == TINY_SMOKE_PROMPTS
    assert again.task("smoke")["details"] == tiny_run.task("smoke")["details"]
    for name in ("smoke", "vision"):
        regressions = [c for c in again.task(name)["checks"] if c["name"].endswith("_vs_baseline")]
        assert regressions and all(c["passed"] for c in regressions), name
    assert "capital-france" in (again.out / "report.md").read_text()


def test_a_calibration_set_holding_a_prompt_and_a_question_flags_them_and_judges_without_them(
    tiny_pair, tiny_run, tmp_path
):
    """`--calibration` on a copy of `tiny_run` (its observations reused: nothing loads): a calibration chat
    whose user turn is smoke's `capital-france` prompt and one whose user turn is vision's chart question
    flag exactly that prompt and that case; smoke's clean_ figures are those of its other prompts' rows, each
    verdict is that of the checks it names, and report.md and the model card show both."""
    from evalsuite.reporting.model_card import render_model_card
    from evalsuite.tasks.vision import VisionSpec

    smoke_spec = load_spec(SmokeSpec, default_spec_path("smoke"))
    france = next(p for p in smoke_spec.prompts if p.id == "capital-france")
    chart = next(c for c in load_spec(VisionSpec, default_spec_path("vision")).cases if c.name == "chart")
    calibration = tmp_path / "calibration.jsonl"
    calibration.write_text(
        "".join(
            json.dumps({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]})
            + "\n"
            for q, a in ((france.prompt, "Paris."), (chart.prompt, "plums"))
        ),
        encoding="utf-8",
    )
    args = ("run", "--ckpt", tiny_pair["tiny-minicpmv47-w4a8"], "--ref", tiny_pair["tiny-minicpmv47-bf16"])
    args += ("--tasks", "smoke,vision", *tiny_spec_args(), "--corpus", "python-docs")
    args += ("--calibration", calibration)
    again = rerun(tiny_run, tmp_path / "again", *args)
    assert again.cli.returncode == 1, again.cli.stderr  # vision's answer checks fail, as in tiny_run
    assert again.loads == []  # a calibration file changes no observation
    smoke, vision = again.task("smoke"), again.task("vision")
    m = smoke["metrics"]
    assert m["calibration_flagged_prompts"] == 1 and m["calibration_flagged_prompt_list"] == "capital-france"
    assert m["calibration_source"] == str(calibration)
    prompts = [row for row in smoke["details"] if "table" not in row]
    kept = [row for row in prompts if row["id"] != "capital-france"]
    assert len(prompts) == TINY_SMOKE_PROMPTS and m["clean_n_prompts"] == len(kept)
    for name, count in (
        ("ref_pass", lambda r: r["ref_pass"]),
        ("ckpt_pass", lambda r: r["ckpt_pass"]),
        ("ref_pass_ckpt_fail", lambda r: r["ref_pass"] and not r["ckpt_pass"]),
        ("diverged_outside_top5", lambda r: r["ckpt_token_in_ref_top5"] is False),
    ):
        assert m[f"clean_{name}"] == sum(bool(count(r)) for r in kept), name
        assert m[name] == sum(bool(count(r)) for r in prompts), name
    assert m["clean_survival_8_n"] in (m["survival_8_n"] - 1, m["survival_8_n"])
    checks = {c["name"]: c["passed"] for c in smoke["checks"]}
    assert {"clean_ref_pass_ckpt_fail", "clean_diverged_outside_top5"} <= set(checks)
    clean = [ok for name, ok in checks.items() if name.startswith("clean_")]
    others = [ok for name, ok in checks.items() if not name.startswith("clean_")]
    verdict = {True: "pass", False: "fail"}
    assert (m["verdict_with_flagged"], m["verdict_without_flagged"]) == (
        verdict[all(others)],
        verdict[all(clean)],
    )
    flagged_row = {"table": "overlapping the calibration set (flagged)", "prompt": "capital-france"}
    assert [r for r in smoke["details"] if "table" in r] == [{**flagged_row, "overlap share": 1.0}]
    v = vision["metrics"]
    assert v["calibration_flagged_cases"] == 1 and v["calibration_flagged_case_list"] == "chart"
    # The single image's answer checks fail with or without the chart's.
    outside_chart = [c["passed"] for c in vision["checks"] if not c["name"].startswith("chart.")]
    assert not all(outside_chart) and (v["verdict_with_flagged"], v["verdict_without_flagged"]) == (
        "fail",
        "fail",
    )
    report = (again.out / "report.md").read_text(encoding="utf-8")
    assert report.count("overlapping the calibration set (flagged)") == 2
    assert "| capital-france | 1 |" in report and "| chart | 1 |" in report
    card = render_model_card(again.results)
    verdicts = m["verdict_with_flagged"], m["verdict_without_flagged"]
    said = (
        "1 prompt overlaps it by more than 0.05: `capital-france` (verdict with them: {}, without them: {})."
    )
    assert said.format(*verdicts) in card, card
    assert (
        "1 case overlaps it by more than 0.05: `chart` (verdict with them: fail, without them: fail)." in card
    )


def _line_of(text: str, occurrence: int, needle: str) -> int:
    return [n for n, line in enumerate(text.splitlines(), 1) if needle in line][occurrence]


@pytest.mark.parametrize(
    ("edit", "line"),
    [
        # The bad regular expression's own line.
        (lambda t: t.replace('expect = "tokyo"', 'expect = "tok(yo"', 1), lambda t: _line_of(t, 0, "tok(yo")),
        # A missing field: the line of the table that lacks it (the second prompt's header).
        (
            lambda t: t.replace('prompt = "What is the capital of Japan?"\n', "", 1),
            lambda t: _line_of(t, 1, "[[prompts]]"),
        ),
    ],
    ids=["bad-regex", "missing-field"],
)
def test_a_bad_prompt_spec_is_refused_with_file_and_line(tiny_pair, tmp_path, edit, line):
    from evalsuite.contract.spec import default_spec_path

    text = edit(default_spec_path("smoke").read_text())
    spec = tmp_path / "smoke.toml"
    spec.write_text(text)
    ref = tiny_pair["tiny-minicpmv47-bf16"]
    args = ("run", "--ckpt", ref, "--ref", ref, "--tasks", "smoke", "--spec", f"smoke={spec}")
    code, errors, _ = cli_in_process(*args, "--out", tmp_path / "out", "--quiet")
    assert code == 2 and len(errors) == 1, errors
    assert str(spec) in errors[0] and f"(line {line(text)})" in errors[0] and "prompts.1" in errors[0], errors


@pytest.mark.slow
def test_smollm2_smoke_answers_paris_and_the_report_shows_both_answers(smollm2_run):
    smoke = smollm2_run.task("smoke")
    assert smoke["metrics"]["n_prompts"] == len(smoke["details"]) >= 10
    france = next(row for row in smoke["details"] if row["id"] == "capital-france")
    assert "Paris" in france["ref_answer"] and france["ref_pass"]
    report = (smollm2_run.out / "report.md").read_text()
    assert "capital-france" in report and "ref_answer" in report and "ckpt_answer" in report
    # Where the answers part, each side's token shown is the one its own answer continues with at the mark.
    import ast

    parted = [row for row in smoke["details"] if row.get("ckpt_token") is not None]
    assert parted
    for row in parted:
        for side in ("ref", "ckpt"):
            after_mark = row[f"{side}_answer"].split("⟦", 1)[1]
            assert after_mark.startswith(ast.literal_eval(row[f"{side}_token"])), (row["id"], side)


def test_smoke_checks_fail_on_a_candidate_built_to_fail_them(tiny_pair, tiny_run, tmp_path):
    """A copy with every weight scale ×4 loses the answer the reference gives and leaves its top-5."""
    import re

    ref = tiny_pair["tiny-minicpmv47-bf16"]
    broken = wrong_scale_copy(tiny_pair["tiny-minicpmv47-w4a8"], tmp_path / "wrong-scale")
    # The random reference answers gibberish; a prompt whose expected answer is the start of that gibberish
    # is one the reference passes, so the candidate must pass it too (the reference's answer to the shipped
    # set's first prompt, the one written below, in the session's run).
    first = tiny_run.task("smoke")["details"][0]
    assert first["id"] == "capital-france", first["id"]
    answer = first["ref_answer"].replace(DIVERGENCE_MARK, "", 1)  # the mark where the candidate's parts
    assert len(answer) >= 8, answer
    spec = tmp_path / "smoke.toml"
    spec.write_text(
        "[thresholds]\nref_pass_ckpt_fail = { max = 0 }\ndiverged_outside_top5 = { max = 0 }\n\n"
        '[[prompts]]\nid = "echo"\ncategory = "factual"\nprompt = "What is the capital of France?"\n'
        f"max_new_tokens = 24\nexpect = {json.dumps(re.escape(answer[:8]))}\n"
    )
    res = cli_run_in_process(
        "run",
        "--ckpt",
        broken,
        "--ref",
        ref,
        "--tasks",
        "smoke",
        "--spec",
        f"smoke={spec}",
        "--out",
        tmp_path / "out",
        "--quiet",
    )
    assert res.returncode == 1, res.stderr
    smoke = task_result(tmp_path / "out", "smoke")
    assert smoke["metrics"]["ref_pass"] == 1 and smoke["metrics"]["ckpt_pass"] == 0
    failed = {c["name"] for c in smoke["checks"] if not c["passed"]}
    assert failed == {"ref_pass_ckpt_fail", "diverged_outside_top5"}
