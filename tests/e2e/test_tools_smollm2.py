"""Slow tier: the `tools` task on the SmolLM2 W4A8 pair over its whole shipped set. SmolLM2's template takes
no tools, so every case is asked in JSON mode and each row says so; each outcome is read off the answers
each side decoded, and the numbers reach report.md and the model card with their samples and intervals. A
candidate built from the BF16 source whose head cannot say `{` (the rows of every token holding it scaled
to nothing, the head untied from the embeddings so the prompt reads as before) fails the parse check."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from evalsuite.fixtures.names import SMOLLM2_BF16, SMOLLM2_W4A8
from evalsuite.reporting.diff_report import format_number
from tests.conftest import Run, cli_run_in_process, copy_checkpoint, edit_tensors, run_pair, shared_run
from tests.e2e.test_tools import assert_figures_are_read_off_the_rows

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2_tools(smollm2_pair, tmp_path_factory) -> Run:
    return shared_run(
        tmp_path_factory,
        "smollm2-tools",
        lambda out: run_pair(smollm2_pair[SMOLLM2_W4A8], smollm2_pair[SMOLLM2_BF16], out, "tools").cli,
    )


def no_open_brace(source: Path, folder: Path) -> Path:
    """`source` with an untied head (a copy of its embeddings) whose rows of every token holding `{` are
    scaled to nothing: the model reads its prompt as before and can never write an object's brace."""
    from transformers import AutoTokenizer

    broken = copy_checkpoint(source, folder)
    config = json.loads((broken / "config.json").read_text())
    config["tie_word_embeddings"] = False
    (broken / "config.json").write_text(json.dumps(config))
    vocab = AutoTokenizer.from_pretrained(broken).get_vocab()
    braces = [i for token, i in vocab.items() if "{" in token]

    def edit(tensors):
        head = tensors["model.embed_tokens.weight"].clone()
        head[braces] = 0.0
        tensors["lm_head.weight"] = head

    edit_tensors(broken, edit)
    return broken


def test_on_smollm2_the_whole_set_is_read_off_the_answers_and_reaches_the_report_and_card(smollm2_tools):
    assert smollm2_tools.cli.returncode in (0, 1), smollm2_tools.cli.stderr
    assert_figures_are_read_off_the_rows(smollm2_tools)
    m = smollm2_tools.metrics("tools")
    assert m["n_cases"] >= 40 and m["n_json_mode"] == m["n_cases"]  # SmolLM2's template takes no tools
    assert m["ref_parsed"] > 0, (
        m
    )  # the real model answers in JSON: the figures rest on outcomes of both kinds
    report = (smollm2_tools.out / "report.md").read_text(encoding="utf-8")
    low, high = (format_number(m[f"parse_rate_ref_{b}95"]) for b in ("lower", "upper"))
    assert f"share of the {m['n_cases']} cases whose reference's answer holds a JSON object" in report
    res = cli_run_in_process("report", smollm2_tools.out, "--format", "model-card")
    assert res.returncode == 0, res.stderr
    card = (smollm2_tools.out / "model-card.md").read_text(encoding="utf-8")
    assert f"| parsed | {format_number(m['parse_rate_ref'])} [{low}, {high}] |" in card, card


def test_on_smollm2_a_candidate_that_cannot_open_an_object_fails_the_parse_check(smollm2_pair, tmp_path):
    broken = no_open_brace(smollm2_pair[SMOLLM2_BF16], tmp_path / "no-open-brace")
    run = run_pair(broken, smollm2_pair[SMOLLM2_BF16], tmp_path / "broken", "tools")
    assert run.cli.returncode == 1, run.cli.stderr
    m = run.metrics("tools")
    assert m["ckpt_parsed"] < m["ref_parsed"] and m["parse_lost"] > 0, m
    failed = {c["name"] for c in run.task("tools")["checks"] if not c["passed"]}
    assert "parse_rate_drop" in failed, failed
