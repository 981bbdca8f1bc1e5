"""`--execution-floor`: the reference's `ppl` windows forwarded four at a time and compared with its own
windows forwarded alone, reported beside the candidate's difference with the outcome of the paired test
(within, above or undetermined) in results.json and report.md; a streamed reference, which runs each window
alone through each layer, has no such execution and says so rather than reporting a difference of zero; and
a recording made with it replays it."""

from __future__ import annotations

import math

from evalsuite.fixtures import TINY_BF16, TINY_W4A8
from tests.conftest import assert_refused, cli_in_process, cli_run_in_process, run_pair


def test_the_reference_against_itself_batched_is_reported_beside_the_candidate(tiny_pair, tmp_path):
    run = run_pair(tiny_pair[TINY_W4A8], tiny_pair[TINY_BF16], tmp_path / "run", "ppl", "--execution-floor")
    assert run.cli.returncode in (0, 1), run.cli.stderr
    m = run.metrics("ppl")
    assert m["execution_floor_windows_per_forward"] == 4
    assert m["execution_floor_kld_mean"] >= 0 and 0 <= m["execution_floor_same_top_p"] <= 1
    # The statistic the outcome is tested on: the candidate's KLD minus the floor's, paired by token.
    assert math.isclose(
        m["execution_floor_excess"], m["kld_mean"] - m["execution_floor_kld_mean"], abs_tol=1e-9
    )
    low, high = m["execution_floor_excess_lower95"], m["execution_floor_excess_upper95"]
    expected = "within" if high <= 0 else "above" if low > 0 else "undetermined"
    assert m["execution_floor"] == expected
    report = (run.out / "report.md").read_text(encoding="utf-8")
    assert "the reference's own execution difference (its windows 4 at a time" in report, report
    # Without the flag nothing of it is observed or said.
    plain = run_pair(tiny_pair[TINY_W4A8], tiny_pair[TINY_BF16], tmp_path / "plain", "ppl")
    assert not [k for k in plain.metrics("ppl") if k.startswith("execution_floor")]


def test_a_streamed_reference_has_no_execution_floor_and_says_why(tiny_pair, tmp_path):
    args = ("--execution-floor", "--stream")
    run = run_pair(tiny_pair[TINY_W4A8], tiny_pair[TINY_BF16], tmp_path / "run", "ppl", *args)
    assert run.cli.returncode in (0, 1), run.cli.stderr
    ppl = run.task("ppl")
    assert ppl["metrics"]["execution_floor"] is None and ppl["metrics"]["execution_floor_kld_mean"] is None
    assert "one window at a time" in ppl["null_reasons"]["execution_floor"]
    report = (run.out / "report.md").read_text(encoding="utf-8")
    assert "the reference's own execution difference was not measured" in report.lower()


def test_a_recording_made_with_it_replays_it(tiny_pair, tmp_path):
    recording = tmp_path / "recording"
    args = ("--tasks", "ppl", "--corpus", "python-docs", "--execution-floor", "--quiet")
    made = cli_run_in_process("record", "--ckpt", tiny_pair[TINY_BF16], "--out", recording, *args)
    assert made.returncode == 0, made.stderr
    live = run_pair(tiny_pair[TINY_W4A8], tiny_pair[TINY_BF16], tmp_path / "live", "ppl", "--execution-floor")
    replay = run_pair(tiny_pair[TINY_W4A8], recording, tmp_path / "replay", "ppl", "--execution-floor")
    assert replay.cli.returncode == live.cli.returncode, replay.cli.stderr
    # The reference's own figures replay as observed; the excess is paired with the candidate's KLD, which
    # a replay computes against the recorded (compacted) reference logits, so it is held to its definition.
    own = (
        "kld_mean",
        "kld_mean_stderr_window",
        "same_top_p",
        "same_top_p_stderr_window",
        "windows_per_forward",
    )
    floor = {k: live.metrics("ppl")[f"execution_floor_{k}"] for k in own}
    replayed = replay.metrics("ppl")
    assert {k: replayed[f"execution_floor_{k}"] for k in own} == floor
    assert math.isclose(
        replayed["execution_floor_excess"],
        replayed["kld_mean"] - replayed["execution_floor_kld_mean"],
        abs_tol=1e-9,
    )


def test_the_flag_without_ppl_is_refused_before_any_model_loads(tiny_pair, tmp_path):
    code, lines, _ = cli_in_process(
        "run", "--ckpt", tiny_pair[TINY_W4A8], "--ref", tiny_pair[TINY_BF16], "--tasks", "tensors",
        "--execution-floor", "--out", tmp_path / "run", "--quiet",
    )  # fmt: skip
    assert_refused(code, lines, "--execution-floor", "add ppl to --tasks")
    assert not (tmp_path / "run" / "observations").exists()
