"""`longform` on the tiny MiniCPM-V 4.7 pair (its random answers mean nothing; the mechanism is checked, on a
few prompts and small budgets): each row says what each side decoded, report.md and the card carry the task;
a recorded reference replays to the live run's results; a streamed side decodes the loaded run's answers in
the spec's batches; a candidate made to loop (its head zeroed: the same token forever) fails the loop check
where the reference does not loop, and loses right answers the McNemar check sees; a chat template that
takes `enable_thinking` is asked both ways, the candidate's looping thought failing the thought's check."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from evalsuite.contract.observation import Observation
from evalsuite.fixtures import TINY_BF16, TINY_W4A8
from evalsuite.observers.greedy_answers import answer_set
from evalsuite.reporting.model_card import render_model_card
from evalsuite.stats import answers
from evalsuite.tasks.long_answers import vocabulary_bytes
from tests.conftest import Run, cli_run_in_process, copy_checkpoint, edit_tensors, rerun, run_pair

SHIPPED = Path(__file__).resolve().parents[2] / "tasks" / "longform.toml"
# A Qwen3-style template: `enable_thinking` false closes an empty thought in the prompt, true opens one.
THINKING_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}"
    "{% else %}{{ '<think>\\n' }}{% endif %}{% endif %}"
)


def subset_spec(folder: Path, budgets: dict[str, int], batch: int, expect: str | None = None) -> Path:
    """The shipped spec with the prompts of `budgets` (id → its budget), decoded `batch` at a time; with
    `expect`, that expected answer for every prompt."""
    text = SHIPPED.read_text(encoding="utf-8")
    head, *blocks = text.split("\n[[prompts]]")
    head = head.replace("batch = 32", f"batch = {batch}")
    kept = []
    for block in blocks:
        pid = re.search(r'^id = "([^"]+)"', block, flags=re.MULTILINE)
        if pid and pid.group(1) in budgets:
            block = block.rstrip("\n") + f"\nmax_new_tokens = {budgets[pid.group(1)]}\n"
            if expect is not None:
                block = re.sub(r"^expect = .*$", lambda _: f"expect = '{expect}'", block, flags=re.MULTILINE)
            kept.append(block)
    assert len(kept) == len(budgets)
    path = folder / f"longform-{len(budgets)}.toml"
    path.write_text(head + "".join("\n[[prompts]]" + b for b in kept), encoding="utf-8")
    return path


def observation(run: Run, role: str) -> Observation:
    (folder,) = (run.out / "observations").glob(f"{role}-longform-answers-*")
    return Observation.load(folder)


def looping_copy(src: Path, dst: Path) -> Path:
    """A copy of a checkpoint whose head scores every token 0: greedy decoding then picks token 0 at every
    step, forever (the head is not tied to the embeddings here, so the prompt is read as before)."""
    copy_checkpoint(src, dst)
    edit_tensors(dst, lambda t: t.update({"lm_head.weight": t["lm_head.weight"] * 0}))
    return dst


def replacement_characters(checkpoint: Path, tokens: list[int], text: str, stop: str) -> int:
    """The U+FFFD an answer's text holds, less a last one for a character its budget cut (its bytes read
    through the checkpoint's tokenizer)."""
    from transformers import AutoTokenizer

    table = vocabulary_bytes(AutoTokenizer.from_pretrained(checkpoint))
    content = tokens if stop == "budget" else tokens[:-1]
    data = None if table is None else b"".join(table.get(t, b"") for t in content)
    return answers.replacement_characters(text, data, stop == "eos")


def with_template(folder: Path, template: str) -> Path:
    (folder / "chat_template.jinja").write_text(template, encoding="utf-8")
    return folder


MECHANISM = {"pencils-cost": 8, "why-sky-blue-zh": 8, "count-to-forty": 8}


@pytest.fixture(scope="module")
def loaded(tiny_pair, tmp_path_factory) -> tuple[Run, Path]:
    """The tiny W4A8 copy against its source, three prompts (English, Chinese, repetition) of 8 tokens."""
    folder = tmp_path_factory.mktemp("longform")
    spec = subset_spec(folder, MECHANISM, batch=3)
    run = run_pair(
        tiny_pair[TINY_W4A8],
        tiny_pair[TINY_BF16],
        folder / "loaded",
        "longform",
        "--spec",
        f"longform={spec}",
    )
    assert run.cli.returncode in (0, 1), run.cli.stderr
    return run, spec


def test_rows_say_what_each_side_decoded_and_the_report_and_card_carry_the_task(tiny_pair, loaded):
    run, _ = loaded
    folders = {"ref": tiny_pair[TINY_BF16], "ckpt": tiny_pair[TINY_W4A8]}
    entry = run.task("longform")
    rows, m = entry["details"], entry["metrics"]
    assert [r["id"] for r in rows] == list(MECHANISM)
    for side in ("ref", "ckpt"):
        shown = answer_set(observation(run, side))
        assert run.results["tasks"]["longform"]["metrics"][f"{side}_answers_decoded"].startswith(
            "decoded alone"
        )
        for row, tokens, text in zip(rows, shown.tokens, shown.texts, strict=True):
            assert row[f"{side}_answer"] == text and row[f"{side}_length"] == len(tokens)
            assert row[f"{side}_stop"] == ("budget" if len(tokens) == 8 and tokens[-1] != 2 else "eos")
            assert row[f"{side}_fffd"] == replacement_characters(
                folders[side], tokens, text, row[f"{side}_stop"]
            )
            assert row[f"{side}_loop"] is False  # 8 tokens: too few to be called a loop
    assert m["n_prompts"] == 3 and m["thinking_modes"].startswith("one")
    assert (
        m["length_ratio_n"] == 3
        and m["length_ratio_lower95"] <= m["length_ratio"] <= m["length_ratio_upper95"]
    )
    assert entry["null_reasons"]["ckpt_thought_loops_not_ref"].startswith("the chat template takes no")
    report = (run.out / "report.md").read_text(encoding="utf-8")
    card = render_model_card(run.results)
    assert "## longform:" in report and "| loops_ckpt |" in report and "pencils-cost" in report
    assert "Long greedy answers to 3 prompts (`longform`)" in card
    assert "| answers ending in a loop (last 64 tokens periodic, period ≤ 32) | 0 of 3 [0, 0.56] |" in card


def test_a_recorded_reference_replays_to_the_live_runs_results(tiny_pair, loaded, tmp_path):
    run, spec = loaded
    spec_args = ("--spec", f"longform={spec}")
    recorded = cli_run_in_process(
        "record", "--ckpt", tiny_pair[TINY_BF16], "--tasks", "longform", *spec_args,
        "--out", tmp_path / "rec", "--quiet",
    )  # fmt: skip
    assert recorded.returncode == 0, recorded.stderr
    replay = rerun(
        run, tmp_path / "replay", "run", "--ckpt", tiny_pair[TINY_W4A8], "--ref", tmp_path / "rec",
        "--tasks", "longform", *spec_args,
    )  # fmt: skip
    assert replay.cli.returncode in (0, 1), replay.cli.stderr
    assert not replay.loads  # the candidate's answers reused, the reference's replayed: no model loaded
    live, again = run.task("longform"), replay.task("longform")
    assert again["metrics"] == live["metrics"] and again["details"] == live["details"]


def test_a_baseline_with_more_right_answers_is_a_regression_and_itself_is_none(tiny_pair, loaded, tmp_path):
    run, spec = loaded
    args = ("run", "--ckpt", tiny_pair[TINY_W4A8], "--ref", tiny_pair[TINY_BF16], "--tasks", "longform")
    args += ("--corpus", "python-docs", "--spec", f"longform={spec}")
    accepted = run.results
    (tmp_path / "same.json").write_text(json.dumps(accepted), encoding="utf-8")
    same = rerun(run, tmp_path / "same", *args, "--baseline", tmp_path / "same.json")
    against = {c["name"]: c["passed"] for c in same.task("longform")["checks"] if "baseline" in c["name"]}
    assert same.loads == [] and against == {"right_ckpt_vs_baseline": True, "loops_ckpt_vs_baseline": True}
    # A baseline whose candidate was right once more: this run has lost a right answer against it.
    accepted["tasks"]["longform"]["metrics"]["right_ckpt"] += 1
    (tmp_path / "better.json").write_text(json.dumps(accepted), encoding="utf-8")
    worse = rerun(run, tmp_path / "worse", *args, "--baseline", tmp_path / "better.json")
    assert worse.cli.returncode == 1, worse.cli.stderr
    failed = [c["name"] for c in worse.task("longform")["checks"] if not c["passed"]]
    assert "right_ckpt_vs_baseline" in failed and "loops_ckpt_vs_baseline" not in failed, failed


def test_a_streamed_side_decodes_the_loaded_runs_answers_in_the_specs_batches(tiny_pair, loaded, tmp_path):
    run, spec = loaded
    streamed = run_pair(
        tiny_pair[TINY_W4A8], tiny_pair[TINY_BF16], tmp_path / "streamed", "longform",
        "--spec", f"longform={spec}", "--stream",
    )  # fmt: skip
    assert streamed.cli.returncode in (0, 1), streamed.cli.stderr
    entry = streamed.task("longform")
    assert entry["status"] not in ("skipped", "error"), entry.get("reason")
    m = entry["metrics"]
    assert m["answers_compared"].startswith("decoded in batches of up to 3")
    for side in ("ref", "ckpt"):
        batch = answer_set(observation(run, side), "batch")
        assert observation(streamed, side).meta["configuration"]["decoded"] == ["batch"]
        assert answer_set(observation(streamed, side)).tokens == batch.tokens, side
        rows = entry["details"]
        assert [r[f"{side}_answer"] for r in rows] == batch.texts
        assert [r[f"{side}_length"] for r in rows] == [len(t) for t in batch.tokens]
        assert (
            m[f"{side}_batch_sensitive"] is None
            and "only" in entry["null_reasons"][f"{side}_batch_sensitive"]
        )


def test_a_candidate_made_to_loop_fails_where_the_reference_does_not_loop(tiny_pair, tmp_path):
    looping = looping_copy(tiny_pair[TINY_BF16], tmp_path / "looping")
    # One prompt long enough to loop (66 tokens), six short ones whose every non-empty answer counts as right
    # (the looping candidate's answer is token 0 again and again, a special token: an empty text).
    short = [
        "pencils-cost",
        "apples-boxes",
        "python-gcd",
        "why-sky-blue",
        "why-seasons-zh",
        "months-of-the-year",
    ]
    spec = subset_spec(tmp_path, {"count-to-forty": 66, **dict.fromkeys(short, 2)}, batch=1, expect="(?s)\\S")
    run = run_pair(looping, tiny_pair[TINY_BF16], tmp_path / "run", "longform", "--spec", f"longform={spec}")
    assert run.cli.returncode == 1, run.cli.stderr
    entry = run.task("longform")
    m, rows = entry["metrics"], entry["details"]
    long_row = next(r for r in rows if r["id"] == "count-to-forty")
    assert (
        long_row["ref_loop"] is False and long_row["ckpt_loop"] is True and long_row["ckpt_loop_period"] == 1
    )
    assert answers.loop_period(answer_set(observation(run, "ckpt")).tokens[rows.index(long_row)]) == 1
    assert (m["loops_ref"], m["ckpt_loops_not_ref"]) == (0, 1)
    assert (m["right_ref"], m["right_ckpt"], m["right_lost"]) == (7, 0, 7) and m["right_lost_shown"] is True
    failed = {c["name"] for c in entry["checks"] if not c["passed"]}
    assert failed == {"ckpt_loops_not_ref", "right_lost_shown"}
    assert any(d["name"] == "longform right final answers" and d["worse"] for d in entry["differences"])
    card = render_model_card(run.results)
    assert "Longform prompt `count-to-forty`: the candidate's answer loops, the reference's does not" in card
    # The reference against itself: nothing lost, nothing looping.
    same = run_pair(tiny_pair[TINY_BF16], tiny_pair[TINY_BF16], tmp_path / "same", "longform",
                    "--spec", f"longform={spec}")  # fmt: skip
    checks = {c["name"]: c["passed"] for c in same.task("longform")["checks"]}
    assert checks == {"ckpt_loops_not_ref": True}, checks  # right_lost_shown: 0 discordant, not measured


def test_a_thinking_template_is_asked_both_ways_and_a_looping_thought_fails(tiny_pair, tmp_path):
    ref = with_template(copy_checkpoint(tiny_pair[TINY_BF16], tmp_path / "ref"), THINKING_TEMPLATE)
    looping = with_template(looping_copy(tiny_pair[TINY_BF16], tmp_path / "looping"), THINKING_TEMPLATE)
    spec = subset_spec(tmp_path, {"count-to-forty": 66}, batch=1)
    run = run_pair(looping, ref, tmp_path / "run", "longform", "--spec", f"longform={spec}")
    assert run.cli.returncode == 1, run.cli.stderr
    entry = run.task("longform")
    m, rows = entry["metrics"], entry["details"]
    assert m["thinking_modes"].startswith("both") and [r["mode"] for r in rows] == ["answer", "thinking"]
    plain, thinking = rows
    assert "ref_thought_tokens" not in plain and plain["ckpt_loop"] is True
    # The template opened the thought and no answer closed it: all of each answer is thought.
    assert thinking["ref_thought_unclosed"] and thinking["ckpt_thought_unclosed"]
    assert thinking["ckpt_thought_tokens"] == 66 and thinking["ckpt_thought_loop"] is True
    assert thinking["ref_thought_loop"] is False and thinking["ckpt_loop"] is False
    failed = {c["name"] for c in entry["checks"] if not c["passed"]}
    assert failed == {"ckpt_loops_not_ref", "thinking_ckpt_thought_loops_not_ref"}
    assert m["ckpt_thought_loops_not_ref"] is None and m["thinking_ckpt_thought_loops_not_ref"] == 1
    card = render_model_card(run.results)
    assert "| outcome (thinking mode) |" in card and "| thoughts ending in a loop | 0 of 1" in card
