"""`specdec` on real tiny models: drafting (Transformers' assisted generation) leaves each side's greedy
answers as they are, counted rounds are the target's forwards, a candidate whose forward depends on the
number of tokens in the call fails the drafting check, a draft checkpoint drafts (and one of another
tokenizer is refused), a streamed side and a recorded reference give the loaded run's results, and the tiny
MiniCPM-V pair, a stateful model Transformers will not draft for, is skipped with the reason.

The mechanism runs on the tiny random Llama (`tiny-llama-bf16`) and a W4A8 copy of it written here with the
SmolLM2 policy, in float32 (a random model's near ties would otherwise be BF16's); the whole shipped prompt
set is SmolLM2's, in the slow tier (`test_specdec_smollm2.py`)."""

from __future__ import annotations

import json
import re
import shutil
import tomllib
from pathlib import Path

import pytest

from evalsuite.backends import load_backend
from evalsuite.backends.drafting import Drafting
from evalsuite.backends.options import BackendOptions
from evalsuite.contract.observation import Observation
from evalsuite.contract.spec import default_spec_path
from evalsuite.files.checkpoint import Checkpoint
from evalsuite.fixtures import SMOLLM2_BF16, TINY_BF16, TINY_W4A8, build_fixtures
from evalsuite.fixtures.smollm2 import SMOLLM2_W4A8_POLICY
from evalsuite.fixtures.w4a8 import write_w4a8_copy
from evalsuite.observers.greedy_answers import model_inputs
from evalsuite.reporting.model_card import render_model_card
from tests.conftest import FIXTURES, Run, assert_refused, cli_in_process, cli_run_in_process, rerun, run_pair

TINY_LLAMA = "tiny-llama-bf16"
TOKENS = 12  # each prompt's budget here: the mechanism, not the prompt set


def specdec_subset_spec(folder: Path, tokens: int = TOKENS) -> Path:
    """The shipped specdec spec with the first prompt of each workload, each answering `tokens` tokens."""
    text = default_spec_path("specdec").read_text(encoding="utf-8")
    head, *blocks = text.split("\n[[prompts]]")
    chosen, seen = [], set()
    for block in blocks:
        category = tomllib.loads("[[prompts]]" + block)["prompts"][0]["category"]
        if category not in seen:
            seen.add(category)
            chosen.append(re.sub(r"max_new_tokens = \d+", f"max_new_tokens = {tokens}", block))
    # The tiny random Llama's next-token distributions are nearly flat: there a near tie is a hundredth of a
    # nat, not the shipped nat a trained model's answers are judged by.
    head = re.sub(r"near_tie = [0-9.]+", "near_tie = 0.01", head)
    path = folder / "specdec-subset.toml"
    path.write_text(head + "".join("\n[[prompts]]" + b for b in chosen), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def llama_pair(tmp_path_factory) -> dict[str, Path]:
    """The tiny Llama, a W4A8 copy of it (INT4 MLP, INT8 attention, dynamic per-token INT8 activations), and
    a candidate built to fail: the same copy whose activations are rounded to 3 bits on one scale per call
    (dynamic per-tensor), so that a verification forward of several tokens rounds each token's activations
    on a scale all of them set, and a forward of one token on its own."""
    root = tmp_path_factory.mktemp("specdec")
    source = build_fixtures(FIXTURES, [TINY_LLAMA])[TINY_LLAMA]
    w4a8 = root / "w4a8"
    write_w4a8_copy(source, w4a8, SMOLLM2_W4A8_POLICY)
    per_call = root / "w4a3-per-call"
    shutil.copytree(w4a8, per_call)
    config = json.loads((per_call / "config.json").read_text(encoding="utf-8"))
    for group in config["quantization_config"]["config_groups"].values():
        group["input_activations"].update(strategy="tensor", num_bits=3)
    (per_call / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    return {"ref": source, "ckpt": w4a8, "per_call": per_call, "spec": specdec_subset_spec(root)}


@pytest.fixture(scope="module")
def loaded_run(llama_pair, tmp_path_factory) -> Run:
    out = tmp_path_factory.mktemp("loaded") / "run"
    return run_pair(llama_pair["ckpt"], llama_pair["ref"], out, "specdec", *spec_args(llama_pair))


def spec_args(pair: dict[str, Path]) -> tuple[str, ...]:
    """The subset spec, in float32."""
    return ("--spec", f"specdec={pair['spec']}", "--dtype", "float32")


def prompt_rows(run: Run) -> list[dict]:
    return [r for r in run.task("specdec")["details"] if r.get("table") == "Prompts"]


def test_drafting_leaves_both_sides_answers_as_they_are_and_counts_rounds(loaded_run):
    assert loaded_run.cli.returncode == 0, loaded_run.cli.stderr
    task = loaded_run.task("specdec")
    m = task["metrics"]
    assert m["ref_lossless"] is True and m["ckpt_lossless"] is True
    assert m["ref_drafting_changed"] == m["ckpt_drafting_changed"] == 0
    rows = prompt_rows(loaded_run)
    assert len(rows) == m["n_prompts"] == 8
    for side in ("ref", "ckpt"):
        # Each prompt's accepted length is its tokens over its rounds, and the rounds add up.
        for row in rows:
            assert row[f"{side}_accept"] == pytest.approx(row[f"{side}_tokens"] / row[f"{side}_rounds"])
            assert 1 <= row[f"{side}_rounds"] <= row[f"{side}_tokens"]
        assert m[f"{side}_rounds"] == sum(r[f"{side}_rounds"] for r in rows)
        assert m[f"{side}_accept_mean_n"] == 8
        low, high = m[f"{side}_accept_mean_lower95"], m[f"{side}_accept_mean_upper95"]
        assert low <= m[f"{side}_accept_mean"] <= high
        # Tokens per second only on a GPU: null here, with the reason.
        assert m[f"{side}_speedup"] is None and "GPU" in task["null_reasons"][f"{side}_speedup"]
    # Prompt lookup accepted something somewhere (else the counts above would hold of plain decoding too).
    assert m["ref_rounds"] < sum(r["ref_tokens"] for r in rows)
    report = (loaded_run.out / "report.md").read_text(encoding="utf-8")
    assert "ref_accept_mean" in report and "ckpt_lossless" in report
    # The card's section: one row per workload and the whole set, with sample sizes and intervals.
    card = render_model_card(loaded_run.results)
    assert "Speculative decoding (`specdec`" in card and "each side decoded 8 prompts" in card
    assert "| trivial repetition | 1 |" in card and "| all | 8 |" in card


def test_a_candidate_whose_forward_depends_on_the_tokens_in_a_call_fails_the_drafting_check(
    llama_pair, loaded_run, tmp_path
):
    """The per-call candidate is not lossless and fails the drafting check (the reference passes), and against
    the W4A8 copy's run as `--baseline` its changed answers are a regression too."""
    pair, baseline = llama_pair, ("--baseline", loaded_run.out / "results.json")
    run = run_pair(pair["per_call"], pair["ref"], tmp_path / "run", "specdec", *spec_args(pair), *baseline)
    assert run.cli.returncode == 1, run.cli.stderr
    task = run.task("specdec")
    m = task["metrics"]
    assert m["ref_lossless"] is True and m["ckpt_lossless"] is False and m["ckpt_drafting_changed"] >= 1
    failed = {c["name"] for c in task["checks"] if not c["passed"]}
    # The default check: a change where the plain decoding was no near tie (its 3-bit activations part the
    # candidate from its own plain answer by more than the rounding of a flat distribution).
    near, beyond = m["ckpt_drafting_near_ties"], m["ckpt_drafting_changed_beyond_near_tie"]
    assert near + beyond == m["ckpt_drafting_changed"] and beyond >= 1, m
    expected = {"ckpt_drafting_changed_beyond_near_tie", "ckpt_drafting_changed_vs_baseline"}
    assert expected <= failed, task["checks"]
    assert not {name for name in failed if name.startswith("ref_")}
    changed = [r for r in prompt_rows(run) if not r["ckpt_lossless"]]
    assert len(changed) == m["ckpt_drafting_changed"]
    assert all("ckpt_change" in r and "ckpt_drafted_answer" in r for r in changed)


def test_an_identical_draft_keeps_every_drafted_token_and_gives_plain_greedy(llama_pair):
    """A draft identical to the target proposes the target's own greedy tokens, so every round keeps all of
    its k drafted tokens and adds the bonus token: 12 tokens with k = 5 are 2 rounds of 6 (the first the
    prompt's prefill with its 5 drafted tokens), 10 drafted tokens verified, and the answer is plain
    greedy's."""
    options = BackendOptions(dtype="float32")
    target = load_backend(Checkpoint.open(llama_pair["ref"]), options)
    draft = load_backend(Checkpoint.open(llama_pair["ref"]), options)
    try:
        x = model_inputs(target.tokenizer("one two three four five six")["input_ids"], None)
        plain = target.generate_greedy(x, TOKENS)
        drafted = target.generate_drafted(x, TOKENS, Drafting(draft=draft.model, draft_tokens=5))
        assert drafted.tokens == plain.tokens and len(plain.tokens) == TOKENS
        assert drafted.counts["rounds"] == 2 and drafted.counts["drafted"] == 10
        assert drafted.counts["seconds"] is None  # not timed on a CPU
        # The steps' rankings are the verification forwards' own: the same top token as plain decoding's.
        assert (drafted.top_ids[:, 0] == plain.top_ids[:, 0]).all()
        # Prompt lookup on the same prompt: the answer is plain greedy's too.
        looked = target.generate_drafted(x, TOKENS, Drafting(lookup_tokens=4, max_ngram=2))
        assert looked.tokens == plain.tokens and 1 <= looked.counts["rounds"] <= TOKENS
    finally:
        draft.close()
        target.close()


def test_a_draft_checkpoint_drafts_and_one_of_another_tokenizer_is_refused(
    llama_pair, loaded_run, smollm2_pair, tmp_path
):
    """In the prompt-lookup run's folder: the plain answers keep their observations' keys, the drafted ones
    get new keys (an observation is keyed by what drafts), so nothing drafted by prompt lookup is reused."""
    pair, args = llama_pair, (*spec_args(llama_pair), "--draft")
    common = ("run", "--ckpt", pair["ckpt"], "--ref", pair["ref"], "--tasks", "specdec")
    run = rerun(loaded_run, tmp_path / "run", *common, *args, pair["ref"])
    assert run.cli.returncode == 0, run.cli.stderr
    names = {
        folder: {p.name for p in (folder / "observations").iterdir()} for folder in (run.out, loaded_run.out)
    }
    drafted = {folder: {n for n in found if "-drafted-" in n} for folder, found in names.items()}
    assert names[run.out] - drafted[run.out] == names[loaded_run.out] - drafted[loaded_run.out]
    assert len(drafted[run.out]) == 2 and not drafted[run.out] & drafted[loaded_run.out]
    m = run.metrics("specdec")
    assert m["ref_lossless"] is True and m["ckpt_lossless"] is True and "draft checkpoint" in m["drafting"]
    # The reference drafted by itself keeps every drafted token: 12 tokens in 2 rounds of 6.
    full = [r for r in prompt_rows(run) if r["ref_tokens"] == TOKENS]
    assert full and all(r["ref_rounds"] == 2 for r in full)
    other = smollm2_pair[SMOLLM2_BF16]
    code, lines, _ = cli_in_process(
        "run", "--ckpt", pair["ckpt"], "--ref", pair["ref"], "--tasks", "specdec", *args, other,
        "--out", tmp_path / "refused", "--quiet",
    )  # fmt: skip
    assert_refused(code, lines, str(other), "tokenizer")


def test_draft_without_specdec_is_refused(llama_pair, tmp_path):
    code, lines, _ = cli_in_process(
        "run", "--ckpt", llama_pair["ckpt"], "--ref", llama_pair["ref"], "--tasks", "tensors",
        "--draft", llama_pair["ref"], "--out", tmp_path / "run", "--quiet",
    )  # fmt: skip
    assert_refused(code, lines, "--draft", "specdec")


def test_a_streamed_side_and_a_recording_give_the_loaded_runs_results(llama_pair, loaded_run, tmp_path):
    pair, spec = llama_pair, spec_args(llama_pair)
    streamed = run_pair(pair["ckpt"], pair["ref"], tmp_path / "streamed", "specdec", *spec, "--stream")
    assert streamed.cli.returncode == 0, streamed.cli.stderr
    assert streamed.metrics("specdec") == loaded_run.metrics("specdec")
    (folder,) = (streamed.out / "observations").glob("ckpt-specdec-drafted-*")
    assert "stream" in json.dumps(Observation.load(folder).meta["execution"]).lower()
    recorded = cli_run_in_process(
        "record", "--ckpt", pair["ref"], "--tasks", "specdec", *spec, "--out", tmp_path / "rec", "--quiet"
    )
    assert recorded.returncode == 0, recorded.stderr
    replay = rerun(
        loaded_run, tmp_path / "replay", "run", "--ckpt", pair["ckpt"], "--ref", tmp_path / "rec",
        "--tasks", "specdec", *spec,
    )  # fmt: skip
    assert replay.cli.returncode == 0, replay.cli.stderr
    assert replay.metrics("specdec") == loaded_run.metrics("specdec")
    # The reference was read from the recording, not loaded (the live run loaded it).
    assert any(line.startswith("loading ref") for line in loaded_run.loads)
    assert not any(line.startswith("loading ref") for line in replay.loads)


def test_the_tiny_minicpmv_pair_is_skipped_as_a_stateful_model(tiny_pair, llama_pair, tmp_path):
    spec = ("--spec", f"specdec={llama_pair['spec']}")
    run = run_pair(tiny_pair[TINY_W4A8], tiny_pair[TINY_BF16], tmp_path / "run", "specdec", *spec)
    task = run.task("specdec")
    assert task["status"] == "skipped", task
    assert "stateful" in task["reason"] and "assisted generation" in task["reason"]
