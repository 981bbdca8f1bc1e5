"""The `tools` task on the tiny pair: every outcome read off the answers each side decoded (rows and figures
agree), a streamed side gives the loaded run's answers in its batches, a recorded reference replays the live
run's results, and the checks fail on a candidate whose answers break JSON where the reference answers in
it (a reference built to answer `{}` and that reference with the head row of `{` scaled to nothing), and
pass on that reference against itself."""

from __future__ import annotations

import json
import re
from pathlib import Path

from evalsuite.contract.spec import default_spec_path
from evalsuite.fixtures import TINY_BF16, TINY_W4A8
from evalsuite.reporting.diff_report import format_number
from evalsuite.stats import metrics
from evalsuite.tasks.answer_pairs import DIVERGENCE_MARK
from evalsuite.tasks.tools._answers import first_json_object
from tests.conftest import Run, cli_run_in_process, copy_checkpoint, edit_tensors, rerun, run_pair

# Two cases the reference built below answers rightly: any JSON object with no property.
EMPTY_OBJECT_CASES = "".join(
    f"""
[[cases]]
id = "empty-{i}"
kind = "json"
prompt = "Answer with an empty JSON object ({i})."
max_new_tokens = 8
schema = '''{{"type": "object", "maxProperties": 0}}'''
expect = '''{{}}'''
"""
    for i in range(2)
)


def tools_subset_spec(folder: Path, extra: str = "") -> Path:
    """The shipped spec with three tool cases and three json cases, each with 8 new tokens: every path of
    the task at a fraction of its decoding steps (the random model's answers mean nothing), plus `extra`."""
    head, *cases = default_spec_path("tools").read_text(encoding="utf-8").split("\n[[cases]]")
    kept = [c for c in cases if 'kind = "tool"' in c][:3] + [c for c in cases if 'kind = "json"' in c][:3]
    kept = [re.sub(r"max_new_tokens = \d+", "max_new_tokens = 8", c) for c in kept]
    path = folder / "tools-short.toml"
    path.write_text(head + "".join("\n[[cases]]" + c for c in kept) + extra, encoding="utf-8")
    return path


def json_reference(source: Path, folder: Path) -> Path:
    """The tiny BF16 model edited to answer `}{}{}{…`: the head has only the rows of `{` and `}`, reading
    one dimension of the last hidden state with opposite signs, and the embeddings of `{` and `}` push that
    dimension hard the other way, so each brace is followed by the other one. Every answer then holds `{}`."""
    from transformers import AutoTokenizer

    reference = copy_checkpoint(source, folder)
    tokenizer = AutoTokenizer.from_pretrained(reference)
    (open_,), (close,) = (tokenizer.encode(b, add_special_tokens=False) for b in "{}")

    def edit(tensors):
        head = tensors["lm_head.weight"]
        head.zero_()
        head[open_, 0], head[close, 0] = 4.0, -4.0
        embed = tensors["model.language_model.embed_tokens.weight"]
        embed[open_, 0], embed[close, 0] = -1000.0, 1000.0
        tensors["model.language_model.norm.weight"][0] = 1.0

    edit_tensors(reference, edit)
    return reference


def no_open_brace(reference: Path, folder: Path) -> Path:
    """The JSON reference with the head row of `{` scaled to nothing: it can never open an object."""
    from transformers import AutoTokenizer

    broken = copy_checkpoint(reference, folder)
    (open_,) = AutoTokenizer.from_pretrained(broken).encode("{", add_special_tokens=False)
    edit_tensors(broken, lambda tensors: tensors["lm_head.weight"][open_].mul_(0.0))
    return broken


def rows_of(run: Run) -> list[dict]:
    return [r for r in run.task("tools")["details"] if "table" not in r]


def assert_figures_are_read_off_the_rows(run: Run) -> None:
    """Each row's parse is that of its shown answer; each side's counts, shares and flips are its rows'."""
    entry = run.task("tools")
    rows, m = rows_of(run), entry["metrics"]
    assert entry["status"] not in ("skipped", "error"), entry.get("reason")
    assert m["n_cases"] == len(rows) and m["n_json_mode"] + m["n_through_template"] == len(rows)
    for row in rows:
        assert row["path"].startswith("JSON mode")  # the tiny template takes no tools
        for side in ("ref", "ckpt"):
            found = first_json_object(row[f"{side}_answer"].replace(DIVERGENCE_MARK, ""))
            assert (row[f"{side}_parsed"] is None) == (found is None), row
    for side in ("ref", "ckpt"):
        parsed = [r[f"{side}_parsed"] is not None for r in rows]
        assert m[f"{side}_parsed"] == sum(parsed)
        share, low, high = metrics.proportion_interval(sum(parsed), len(rows))
        assert (
            m[f"parse_rate_{side}"],
            m[f"parse_rate_{side}_lower95"],
            m[f"parse_rate_{side}_upper95"],
        ) == (
            share,
            low,
            high,
        )
        assert m[f"{side}_right_call"] == sum(r[f"{side}_right_call"] for r in rows)
    flips = metrics.flip_counts(*([r[f"{s}_right_call"] for r in rows] for s in ("ref", "ckpt")))
    assert (m["right_call_lost"], m["right_call_gained"]) == (flips.c2w, flips.w2c)
    report = (run.out / "report.md").read_text(encoding="utf-8")
    assert "## tools:" in report and "95% Wilson interval over cases" in report


def test_tools_on_the_tiny_pair_loaded_and_streamed(tiny_pair, tmp_path):
    """The loaded run's outcomes are read off its answers; a streamed run decodes in the spec's batches
    only and gives the loaded run's answers in those batches."""
    spec = tools_subset_spec(tmp_path)
    args = (tiny_pair[TINY_W4A8], tiny_pair[TINY_BF16])
    loaded = run_pair(*args, tmp_path / "loaded", "tools", "--spec", f"tools={spec}")
    streamed = run_pair(*args, tmp_path / "streamed", "tools", "--spec", f"tools={spec}", "--stream")
    for run in (loaded, streamed):
        assert run.cli.returncode in (0, 1), run.cli.stderr
        assert_figures_are_read_off_the_rows(run)
    assert loaded.metrics("tools")["answers_compared"].startswith("decoded alone")
    assert streamed.metrics("tools")["answers_compared"].startswith("decoded in batches of up to 32")
    for side in ("ref", "ckpt"):
        in_batches = [
            r[f"{side}_answer_in_batch"] if r.get(f"{side}_batch_sensitive") else r[f"{side}_answer"]
            for r in rows_of(loaded)
        ]
        shown = [r[f"{side}_answer"] for r in rows_of(streamed)]
        assert [a.replace(DIVERGENCE_MARK, "") for a in shown] == [
            a.replace(DIVERGENCE_MARK, "") for a in in_batches
        ]
        assert streamed.metrics("tools")[f"{side}_batch_sensitive"] is None


def test_a_recorded_reference_replays_the_live_run(tiny_pair, tmp_path):
    spec = tools_subset_spec(tmp_path)
    live = run_pair(
        tiny_pair[TINY_W4A8], tiny_pair[TINY_BF16], tmp_path / "live", "tools", "--spec", f"tools={spec}"
    )
    assert live.cli.returncode in (0, 1), live.cli.stderr
    record = cli_run_in_process(
        "record", "--ckpt", tiny_pair[TINY_BF16], "--tasks", "tools", "--spec", f"tools={spec}",
        "--corpus", "python-docs", "--out", tmp_path / "recording", "--quiet",
    )  # fmt: skip
    assert record.returncode == 0, record.stderr
    replay = rerun(
        live, tmp_path / "replay", "run", "--ckpt", tiny_pair[TINY_W4A8], "--ref", tmp_path / "recording",
        "--tasks", "tools", "--spec", f"tools={spec}", "--corpus", "python-docs",
    )  # fmt: skip
    assert replay.cli.returncode == live.cli.returncode, replay.cli.stderr
    assert replay.task("tools")["details"] == live.task("tools")["details"]
    a, b = live.metrics("tools"), replay.metrics("tools")
    assert {k: v for k, v in a.items() if not k.endswith("_execution")} == {
        k: v for k, v in b.items() if not k.endswith("_execution")
    }


def test_the_checks_fail_on_a_candidate_whose_answers_break_json(tiny_pair, tmp_path):
    reference = json_reference(tiny_pair[TINY_BF16], tmp_path / "json-reference")
    broken = no_open_brace(reference, tmp_path / "no-open-brace")
    spec = tools_subset_spec(tmp_path, EMPTY_OBJECT_CASES)
    failed = run_pair(broken, reference, tmp_path / "broken", "tools", "--spec", f"tools={spec}")
    assert failed.cli.returncode == 1, failed.cli.stderr
    assert_figures_are_read_off_the_rows(failed)
    m = failed.metrics("tools")
    assert (m["parse_rate_ref"], m["parse_rate_ckpt"], m["ref_right_call"], m["ckpt_right_call"]) == (
        1,
        0,
        2,
        0,
    )
    assert m["parse_lost"] == 8 and m["parse_flip_p"] < 0.01 and m["parse_rate_drop_lower95"] > 0
    verdicts = {c["name"]: c["passed"] for c in failed.task("tools")["checks"]}
    assert verdicts == {"parse_rate_drop": False, "right_call_rate_drop": False}
    assert all(r["ref_answer"].replace(DIVERGENCE_MARK, "").startswith("}{}") for r in rows_of(failed))
    # The card's rows: each side's share with its interval and sample, the drop and the flips.
    assert cli_run_in_process("report", failed.out, "--format", "model-card").returncode == 0
    card = (failed.out / "model-card.md").read_text(encoding="utf-8")
    low, high = (format_number(m[f"parse_rate_drop_{b}95"]) for b in ("lower", "upper"))
    assert "Tool calls and JSON answers to 8 cases" in card
    assert f"| parsed | 1 [{format_number(m['parse_rate_ref_lower95'])}, 1] | 0 [0, " in card
    assert f"| 1 [{low}, {high}] | 8 / 0 (p = {format_number(m['parse_flip_p'])}) |" in card
    # The same reference against itself: nothing lost, both checks pass.
    same = run_pair(reference, reference, tmp_path / "same", "tools", "--spec", f"tools={spec}")
    assert same.cli.returncode == 0, same.cli.stderr
    assert {c["name"]: c["passed"] for c in same.task("tools")["checks"]} == dict.fromkeys(verdicts, True)
    assert same.metrics("tools")["right_call_rate_ckpt"] == 2 / 8
    # --baseline: the broken candidate against the good run's results regresses on each share; the good run
    # against its own results does not (each rerun reuses every observation).
    baseline = tmp_path / "baseline.json"
    baseline.write_text(json.dumps(same.results), encoding="utf-8")
    args = ("--tasks", "tools", "--spec", f"tools={spec}", "--corpus", "python-docs", "--baseline", baseline)
    again = rerun(same, tmp_path / "same-again", "run", "--ckpt", reference, "--ref", reference, *args)
    assert again.cli.returncode == 0 and again.loads == [], again.cli.stderr
    worse = rerun(failed, tmp_path / "worse", "run", "--ckpt", broken, "--ref", reference, *args)
    assert worse.cli.returncode == 1 and worse.loads == [], worse.cli.stderr
    regressed = {c["name"] for c in worse.task("tools")["checks"] if not c["passed"]} - set(verdicts)
    assert regressed == {f"{o}_rate_ckpt_vs_baseline" for o in ("parse", "schema_valid", "right_call")}
