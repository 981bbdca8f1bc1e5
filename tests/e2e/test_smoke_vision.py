"""Tasks `smoke` and `vision` through the CLI: live runs, replays against recordings, refusals."""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_cli, wrong_scale_copy


def task_result(run_dir, name):
    return json.loads((run_dir / "results.json").read_text())["tasks"][name]


@pytest.fixture(scope="module")
def tiny_smoke_vision(tiny_pair, tmp_path_factory):
    """Live and replayed runs of smoke + vision on the tiny MiniCPM-V 4.7 pair."""
    root = tmp_path_factory.mktemp("smoke-vision")
    bf16, w4a8 = tiny_pair["tiny-minicpmv47-bf16"], tiny_pair["tiny-minicpmv47-w4a8"]
    rec = run_cli("record", "--ckpt", bf16, "--out", root / "rec", "--tasks", "smoke,vision", "--quiet")
    assert rec.returncode == 0, rec.stderr
    args = ("run", "--ckpt", w4a8, "--tasks", "smoke,vision", "--quiet")
    live = run_cli(*args, "--ref", bf16, "--out", root / "live")
    replay = run_cli(*args, "--ref", root / "rec", "--out", root / "replay")
    return live, replay, root


def test_random_tiny_model_fails_the_answer_check_and_says_so(tiny_smoke_vision):
    live, _, root = tiny_smoke_vision
    assert live.returncode == 1, live.stderr
    vision = task_result(root / "live", "vision")
    assert vision["status"] == "fail"
    failed = {c["name"] for c in vision["checks"] if not c["passed"]}
    assert failed == {"ref_pass", "ckpt_pass"}  # a random model names no shapes; parity still holds
    report = (root / "live" / "report.md").read_text()
    assert "## vision: fail" in report and "ref_pass" in report


def test_w4a8_copy_keeps_the_vision_tower_exactly(tiny_smoke_vision):
    _, _, root = tiny_smoke_vision
    m = task_result(root / "live", "vision")["metrics"]
    assert m["vision_cosine"] == 1.0 and m["vision_rel_err"] == 0.0 and m["vision_max_abs"] == 0.0
    assert m["processing"].startswith(("processor", "image processor"))
    assert len(m["image_sha256"]) == 64 and (root / "live" / "artifacts" / "vision_image.png").is_file()


def test_replay_gives_the_live_results_for_smoke_and_vision(tiny_smoke_vision):
    _, replay, root = tiny_smoke_vision
    assert replay.returncode == 1, replay.stderr  # the same verdict, without loading the reference
    assert "loading ref" not in replay.stderr
    for name in ("smoke", "vision"):
        live, again = task_result(root / "live", name), task_result(root / "replay", name)
        assert again["metrics"] == live["metrics"], name
        assert again.get("details") == live.get("details"), name


def test_text_only_checkpoint_skips_vision_with_the_reason(smollm2_pair, tmp_path):
    res = run_cli(
        "run",
        "--ckpt",
        smollm2_pair["smollm2-135m-w4a8"],
        "--ref",
        smollm2_pair["smollm2-135m-bf16"],
        "--tasks",
        "vision",
        "--out",
        tmp_path,
        "--quiet",
    )
    assert res.returncode == 2, res.stderr  # nothing was compared: the run shows nothing
    vision = task_result(tmp_path, "vision")
    assert vision["status"] == "skipped" and "text-only" in vision["reason"]


@pytest.mark.parametrize(
    ("edit", "fragment"),
    [
        (lambda text: text.replace('expect = "tokyo"', 'expect = "tok(yo"', 1), "line 27"),
        (lambda text: text.replace('prompt = "What is the capital of Japan?"\n', "", 1), "line 22"),
    ],
    ids=["bad-regex", "missing-field"],
)
def test_a_bad_prompt_spec_is_refused_with_file_and_line(tiny_pair, tmp_path, edit, fragment):
    from evalsuite.spec import default_spec_path

    spec = tmp_path / "smoke.toml"
    spec.write_text(edit(default_spec_path("smoke").read_text()))
    ref = tiny_pair["tiny-minicpmv47-bf16"]
    res = run_cli(
        "run",
        "--ckpt",
        ref,
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
    assert res.returncode == 2 and len(res.error_lines) == 1, res.stderr
    assert (
        str(spec) in res.error_lines[0]
        and fragment in res.error_lines[0]
        and "prompts.1" in res.error_lines[0]
    )


@pytest.mark.slow
def test_smollm2_smoke_answers_paris_and_the_report_shows_both_answers(smollm2_pair, tmp_path):
    res = run_cli(
        "run",
        "--ckpt",
        smollm2_pair["smollm2-135m-w4a8"],
        "--ref",
        smollm2_pair["smollm2-135m-bf16"],
        "--tasks",
        "smoke",
        "--out",
        tmp_path,
        "--quiet",
    )
    assert res.returncode in (0, 1), res.stderr
    smoke = task_result(tmp_path, "smoke")
    assert smoke["metrics"]["n_prompts"] == len(smoke["details"]) >= 10
    france = next(row for row in smoke["details"] if row["id"] == "capital-france")
    assert "Paris" in france["ref_answer"] and france["ref_pass"]
    report = (tmp_path / "report.md").read_text()
    assert "capital-france" in report and "ref_answer" in report and "ckpt_answer" in report


def test_smoke_checks_fail_on_a_candidate_built_to_fail_them(tiny_pair, tmp_path):
    """A copy with every weight scale ×4 loses the answer the reference gives and leaves its top-5."""
    import re

    ref = tiny_pair["tiny-minicpmv47-bf16"]
    broken = wrong_scale_copy(tiny_pair["tiny-minicpmv47-w4a8"], tmp_path / "wrong-scale")
    # The random reference answers gibberish; a prompt whose expected answer is the start of that gibberish
    # is one the reference passes, so the candidate must pass it too.
    first = run_cli(
        "run", "--ckpt", ref, "--ref", ref, "--tasks", "smoke", "--out", tmp_path / "ref", "--quiet"
    )
    answer = task_result(tmp_path / "ref", "smoke")["details"][0]["ref_answer"]
    assert first.returncode in (0, 1) and len(answer) >= 8, first.stderr
    spec = tmp_path / "smoke.toml"
    spec.write_text(
        "[thresholds]\nref_pass_ckpt_fail = { max = 0 }\ndiverged_outside_top5 = { max = 0 }\n\n"
        '[[prompts]]\nid = "echo"\ncategory = "factual"\nprompt = "What is the capital of France?"\n'
        f"max_new_tokens = 24\nexpect = {json.dumps(re.escape(answer[:8]))}\n"
    )
    res = run_cli(
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
