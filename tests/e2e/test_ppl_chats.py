"""`ppl` on chats through the chat template, and the calibration set kept apart from the scored text.

On the tiny MiniCPM-V 4.7 pair (the CLI in this process, `cli_in_process`): a two-turn chat whose template
marks its assistant turns is scored on exactly its assistant tokens, counted by hand; a candidate whose
template differs is refused before any model loads, and so, naming its line, is a chat that opens with the
assistant's or that the template refuses; splits of one chat are reported, not judged; a calibration file
holding two of the protocol's windows flags both, with the verdict given without them, and a disjoint one
flags nothing (a copy of `tiny_run`, its observations reused). On SmolLM2 (slow tier): the shipped chats, by
tag, with chat-clustered intervals.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer

from evalsuite.inputs.corpus import load_corpus
from evalsuite.observers.window_logits import WindowProtocol
from evalsuite.reporting.model_card import render_model_card
from tests.conftest import (
    SMOLLM2_BF16,
    SMOLLM2_W4A8,
    TINY_BF16,
    TINY_W4A8,
    assert_refused,
    cli_in_process,
    copy_checkpoint,
    rerun,
)
from tests.unit.test_chat_tokens import (
    ASSISTANT_TOKENS,
    ASSISTANT_TURNS,
    MARKED_TEMPLATE,
    RAISING_TEMPLATE,
    TWO_TURNS,
)


def _marked_copy(src: Path, dst: Path, template: str = MARKED_TEMPLATE) -> Path:
    copy = copy_checkpoint(src, dst)
    (copy / "chat_template.jinja").write_text(template, encoding="utf-8")
    return copy


def _chat_file(folder: Path) -> Path:
    path = folder / "two-turns.jsonl"
    messages = [{"role": r, "content": c} for r, c in TWO_TURNS.messages]
    path.write_text(json.dumps({"messages": messages, "tag": TWO_TURNS.tag}) + "\n", encoding="utf-8")
    return path


def _results(out: Path) -> dict:
    return json.loads((out / "results.json").read_text(encoding="utf-8"))["tasks"]["ppl"]


def test_a_marked_template_scores_exactly_the_assistant_tokens(tiny_pair, tmp_path):
    ref = _marked_copy(tiny_pair[TINY_BF16], tmp_path / "ref")
    ckpt = _marked_copy(tiny_pair[TINY_W4A8], tmp_path / "ckpt")
    out = tmp_path / "run"
    args = ("run", "--ckpt", ckpt, "--ref", ref, "--tasks", "ppl", "--chats", _chat_file(tmp_path))
    code, lines, _ = cli_in_process(*args, "--out", out, "--quiet", "--no-plots")
    assert code in (0, 1), lines
    ppl = _results(out)
    m = ppl["metrics"]
    assert m["assistant_spans"] == "generation markers"
    assert m["n_chats"] == 1 and m["n_scored_tokens"] == len(ASSISTANT_TOKENS) == 9
    with np.load(out / ppl["artifacts"]["tokens"]) as tokens:
        target, turn = tokens["target"], tokens["turn"]
        assert len(tokens["kld"]) == 9 and np.isfinite(tokens["kld"]).all()
    tokenizer = AutoTokenizer.from_pretrained(ref)
    assert tokenizer.convert_ids_to_tokens(target.tolist()) == ASSISTANT_TOKENS
    assert turn.tolist() == ASSISTANT_TURNS
    # Split by turn: 2 tokens of the first assistant turn, 7 of the second; each split one chat, fewer than
    # the spec's minimum: reported, marked too small, and left out of the verdict.
    assert (m["turn_1_n_tokens"], m["turn_2_n_tokens"]) == (2, 7)
    assert m["turn_1_note"] == m["turn_2_note"] == "too small to judge: 1 chat < 5"
    assert {c["name"] for c in ppl["checks"]} == {"ppl_ratio", "kld_mean", "same_top_p"}
    rows = [r for r in ppl["details"] if r.get("table", "").startswith("by assistant turn")]
    assert [(r["turn"], r["verdict"]) for r in rows] == [("1", m["turn_1_note"]), ("2", m["turn_2_note"])]


def test_a_candidate_whose_chat_template_differs_is_refused_before_any_load(tiny_pair, tmp_path):
    ref = _marked_copy(tiny_pair[TINY_BF16], tmp_path / "ref")
    # The fixture's own template: the same turns, no generation markers, so not the same template.
    ckpt = tiny_pair[TINY_W4A8]
    out = tmp_path / "run"
    args = ("run", "--ckpt", ckpt, "--ref", ref, "--tasks", "ppl", "--chats", _chat_file(tmp_path))
    code, lines, _ = cli_in_process(*args, "--out", out, "--quiet")
    assert_refused(code, lines, str(ckpt), "its chat template differs from the reference's")
    assert not (out / "observations").exists()


@pytest.mark.parametrize(
    ("template", "chat", "said"),
    [
        (
            None,
            [("assistant", "Hello! How can I help?"), ("user", "What is 2+2?"), ("assistant", "4")],
            "line 3: the chat opens with an assistant turn",
        ),
        (
            RAISING_TEMPLATE,
            [("system", "Be brief."), *TWO_TURNS.messages],
            "line 3: the chat template refuses the chat (System role not supported)",
        ),
    ],
)
def test_a_chat_its_template_cannot_render_ends_in_exit_2_naming_its_line(
    tiny_pair, tmp_path, template, chat, said
):
    """A chat that opens with the assistant, and one the template refuses (`raise_exception`), each on the
    third line of its file after a good chat and a blank line: refused in one line, before any load."""
    ref, ckpt = tiny_pair[TINY_BF16], tiny_pair[TINY_W4A8]
    if template is not None:
        ref, ckpt = (
            _marked_copy(ref, tmp_path / "ref", template),
            _marked_copy(ckpt, tmp_path / "ckpt", template),
        )
    path = tmp_path / "chats.jsonl"
    lines = [[{"role": r, "content": c} for r, c in messages] for messages in (TWO_TURNS.messages, chat)]
    path.write_text(f"{json.dumps({'messages': lines[0]})}\n\n{json.dumps({'messages': lines[1]})}\n")
    out = tmp_path / "run"
    args = ("run", "--ckpt", ckpt, "--ref", ref, "--tasks", "ppl", "--chats", path)
    code, lines_out, _ = cli_in_process(*args, "--out", out, "--quiet")
    assert_refused(code, lines_out, str(path), said)
    assert not (out / "observations").exists()


def _window_text(tokenizer, ids: np.ndarray, start: int) -> str:
    return tokenizer.decode(ids[start : start + WindowProtocol().window])


def test_a_calibration_file_holding_two_windows_flags_them_and_judges_without_them(
    tiny_pair, tiny_run, tmp_path
):
    """The protocol's windows on the offline corpus (python-docs: WikiText-2 is not in this machine's cache;
    the protocol is the same). Windows 2 and 5, decoded into a calibration text between other text, are
    flagged with their overlap; the figures and checks without them are given (clean_*); the calibration
    set joined to the README flags nothing else, and the README alone nothing at all."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_pair[TINY_BF16])
    corpus = load_corpus("python-docs")
    ids = np.asarray(tokenizer(corpus.text, add_special_tokens=False)["input_ids"])
    starts = WindowProtocol().window_starts(len(ids))
    readme = (Path(__file__).parents[2] / "README.md").read_text(encoding="utf-8")
    holding = tmp_path / "calibration.txt"
    holding.write_text(
        readme[:2000] + _window_text(tokenizer, ids, starts[2]) + readme[2000:4000]
        + _window_text(tokenizer, ids, starts[5]),
        encoding="utf-8",
    )  # fmt: skip
    disjoint = tmp_path / "disjoint.txt"
    disjoint.write_text(readme, encoding="utf-8")
    args = ("run", "--ckpt", tiny_pair[TINY_W4A8], "--ref", tiny_pair[TINY_BF16], "--tasks", "ppl")
    args += ("--corpus", "python-docs", "--no-plots")
    flagged = rerun(tiny_run, tmp_path / "flagged", *args, "--calibration", holding)
    assert flagged.cli.returncode in (0, 1), flagged.cli.stderr
    assert flagged.loads == []  # a calibration file changes no observation
    ppl = flagged.task("ppl")
    m = ppl["metrics"]
    assert m["calibration_flagged_windows"] == 2 and m["calibration_flagged_window_list"] == "2,5"
    rows = [r for r in ppl["details"] if r.get("table", "").startswith("overlapping the calibration set")]
    assert [(r["window"], r["overlap share"] > 0.9) for r in rows] == [(2, True), (5, True)]
    assert m["calibration_overlap_share"] == pytest.approx(2 / 8, abs=0.01)
    # Without them: six windows' tokens, judged by the spec's own bounds.
    assert m["clean_n_windows"] == 6 and m["clean_n_tokens"] == 6 * 255
    assert {c["name"] for c in ppl["checks"]} >= {"clean_kld_mean", "clean_same_top_p", "clean_ppl_ratio"}
    assert m["clean_kld_mean"] != m["kld_mean"]
    assert {m["verdict_with_flagged"], m["verdict_without_flagged"]} <= {"pass", "fail"}
    card = render_model_card(flagged.results)
    assert "2 windows overlap it by more than" in card
    verdicts = m["verdict_with_flagged"], m["verdict_without_flagged"]
    assert "verdict with them: {}, without them: {}".format(*verdicts) in card
    clear = rerun(tiny_run, tmp_path / "clear", *args, "--calibration", disjoint)
    c = clear.metrics("ppl")
    assert c["calibration_flagged_windows"] == 0 and c["calibration_overlap_share"] == 0.0
    assert not any(k.startswith("clean_") for k in c)
    assert {ch["name"] for ch in clear.task("ppl")["checks"]} == {"ppl_ratio", "kld_mean", "same_top_p"}


@pytest.mark.slow
def test_smollm2_on_the_shipped_chats_gives_each_tag_its_chat_clustered_interval(smollm2_pair, tmp_path):
    out = tmp_path / "run"
    args = (
        "run",
        "--ckpt",
        smollm2_pair[SMOLLM2_W4A8],
        "--ref",
        smollm2_pair[SMOLLM2_BF16],
        "--tasks",
        "ppl",
    )
    code, lines, _ = cli_in_process(*args, "--spec", "ppl=tasks/ppl-chat.toml", "--out", out, "--quiet")
    assert code in (0, 1), lines
    m = _results(out)["metrics"]
    assert m["corpus"] == "chats:shipped" and m["assistant_spans"] == "template rendering"
    assert m["n_windows"] == m["n_chats"] == 110
    for tag, chats in (("zh", 32), ("en", 32), ("math", 32), ("code", 14)):
        assert m[f"tag_{tag}_n_windows"] == chats
        for metric in ("kld_mean", "same_top_p"):
            lo, hi = m[f"tag_{tag}_{metric}_lower95"], m[f"tag_{tag}_{metric}_upper95"]
            assert lo < m[f"tag_{tag}_{metric}"] < hi
            assert m[f"tag_{tag}_{metric}_stderr_window"] > 0
        # Clustered by chat, not by token: the tokens of a chat move together.
        assert m[f"tag_{tag}_kld_mean_stderr_window"] > m[f"tag_{tag}_kld_mean_stderr"] * 0.5
    assert m["turn_1_n_tokens"] + m["turn_2_n_tokens"] + m["turn_3plus_n_tokens"] == m["n_scored_tokens"]
    assert "tag_zh_kld_mean" in {c["name"] for c in _results(out)["checks"]}
    card = render_model_card(json.loads((out / "results.json").read_text(encoding="utf-8")))
    for tag, chats in (("zh", 32), ("en", 32), ("math", 32), ("code", 14)):
        assert f"| tag `{tag}` | {chats} | " in card, card


@pytest.mark.parametrize(
    ("option", "tasks", "said"),
    [
        ("--chats", "tensors", ("--chats is read by `ppl` only", "add ppl to --tasks")),
        ("--chats", "smoke", ("--chats is read by `ppl` only", "add ppl to --tasks")),
        (
            "--calibration",
            "tensors",
            ("--calibration is read by `ppl`, `smoke` and `vision` only", "add one of them to --tasks"),
        ),
    ],
)
def test_a_chats_or_calibration_file_in_a_run_that_would_not_read_it_is_refused_naming_it(
    option, tasks, said, tiny_pair, tmp_path
):
    """`ppl` alone scores chats; `ppl`, `smoke` and `vision` check their texts against a calibration set: a
    run of other tasks would ignore the file and say nothing."""
    given = tmp_path / "chats.jsonl"
    given.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n', encoding="utf-8")
    code, lines, _ = cli_in_process(
        "run", "--ckpt", tiny_pair[TINY_W4A8], "--ref", tiny_pair[TINY_BF16], "--tasks", tasks,
        option, given, "--out", tmp_path / "out", "--quiet",
    )  # fmt: skip
    assert_refused(code, lines, str(given), *said)
