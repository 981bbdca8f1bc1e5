"""`smoke`'s outcomes from answers built by hand (no model): the divergence is where the two decoded answers
part; a near tie is judged at that step by the reference's own gap there, never for a token outside its
top-5, and labels agree with the verdict; a prompt whose answer moves with the batch is marked on its side and
counted; survival at N rests on exactly the prompts whose budget reaches N; every configured length can be
thresholded."""

from __future__ import annotations

import numpy as np
import pytest

from evalsuite.contract.observation import Observation
from evalsuite.contract.spec import load_spec
from evalsuite.errors import InputError
from evalsuite.observers.greedy_answers import answers_observation
from evalsuite.pipeline.plan import build_tasks
from evalsuite.protocol.task import RunContext
from evalsuite.tasks.smoke import Smoke, SmokeSpec

K = 5


def spec_text(budgets: list[int], lengths: str = "[8, 16, 32]", near_tie: float = 1.0) -> str:
    prompts = "".join(
        f'\n[[prompts]]\nid = "p{i}"\ncategory = "factual"\nprompt = "q{i}"\nmax_new_tokens = {n}\n'
        'expect = "a"\n'
        for i, n in enumerate(budgets)
    )
    return (
        f"[generation]\nnear_tie = {near_tie}\n[survival]\nlengths = {lengths}\n"
        "[thresholds]\nref_pass_ckpt_fail = { max = 0 }\ndiverged_outside_top5 = { max = 0 }\n" + prompts
    )


def smoke(tmp_path, budgets: list[int], **kw) -> Smoke:
    path = tmp_path / "smoke.toml"
    path.write_text(spec_text(budgets, **kw), encoding="utf-8")
    return Smoke(load_spec(SmokeSpec, path), RunContext())


def step(own: int, ranked: dict[int, float]) -> tuple[list[int], list[float]]:
    """One decoding step's top-5: `own` first, then the other ids given with their log-probs, then fillers."""
    ids = [own, *ranked]
    logp = [0.0 - 0.01, *ranked.values()]
    fillers = [t for t in range(900, 920) if t not in ids]
    while len(ids) < K:
        ids.append(fillers.pop(0))
        logp.append(-20.0 - len(ids))
    return ids, logp


def document(tokens: list[int], steps: list[tuple[list[int], list[float]]] | None = None) -> dict:
    """An answer document: one character per token, and per step its top-5 (by default the token first and
    nothing close)."""
    steps = steps or [step(t, {}) for t in tokens]
    return {
        "tokens": tokens,
        "text": "".join(chr(ord("a") + t % 26) for t in tokens),
        "char_ends": list(range(1, len(tokens) + 1)),
        "top_text": [[chr(ord("a") + t % 26) for t in ids] for ids, _ in steps],
        "top_ids": [ids for ids, _ in steps],
        "top_logp": [logp for _, logp in steps],
    }


def answers(alone: list[dict], batch: list[dict] | None) -> Observation:
    decoded = ["alone", "batch"] if batch is not None else ["batch"]
    configuration = {"decoded": decoded, "batch": 32, "device": "cpu", "dtype": "bfloat16"}
    return answers_observation("smoke-answers", alone, None, K, {"configuration": configuration}, batch)


def forced(n_tokens: list[int], reference: bool) -> Observation:
    """Forced rows along the reference's answers: every figure zero-divergence (KLD 0, same top)."""
    rows = sum(n_tokens)
    offsets = np.cumsum([0, *n_tokens]).astype(np.int64)
    lp = np.full((rows, 2), np.log(0.5), np.float32)
    common = {"offsets": offsets, "full_offsets": offsets * 0}
    if reference:
        arrays = {
            **common,
            "top_ids": np.tile(np.arange(2, dtype=np.int32), (rows, 1)),
            "top_logp": lp,
            "tail_mass": np.zeros(rows, np.float32),
            "tail_ids": np.zeros((rows, 0), np.int32),
            "tail_logp": np.zeros((rows, 0), np.float32),
        }
        return Observation(name="forced-ref", meta={"top_k": 2, "tail_samples": 0}, arrays=arrays)
    arrays = {
        **common,
        "at_top": lp,
        "at_tail": np.zeros((rows, 0), np.float32),
        "same_top": np.ones(rows, bool),
    }
    return Observation(name="forced", meta={}, arrays=arrays)


def compared(task: Smoke, ref: Observation, ckpt: Observation, tmp_path) -> dict:
    n = [int(ref.arrays["offsets"][i + 1] - ref.arrays["offsets"][i]) for i in range(len(task.spec.prompts))]
    observed = {
        "answers": ref,
        "ckpt-answers": ckpt,
        "forced-ref": forced(n, True),
        "forced": forced(n, False),
    }
    return task.compare(observed, tmp_path).to_json()


def test_a_divergence_is_a_near_tie_only_by_the_references_own_gap_at_its_step(tmp_path):
    """Three prompts part at token 1: on a token the reference ranked 0.3 nats below its own (a near tie), 2.6
    nats below (inside the top-5, not a tie), and not at all among its first five (outside: the verdict
    fails it, and nothing calls it a tie). The candidate's own preference, however small, excuses nothing."""
    task = smoke(tmp_path, [8, 8, 8])
    ref_docs = [
        document([1, 2, 3], [step(1, {}), step(2, {7: -0.31}), step(3, {})]),
        document([1, 2, 3], [step(1, {}), step(2, {7: -2.61}), step(3, {})]),
        document([1, 2, 3], [step(1, {}), step(2, {}), step(3, {})]),
    ]
    ckpt_docs = [document([1, 7, 3], [step(1, {}), step(7, {2: -0.001}), step(3, {})]) for _ in range(3)]
    result = compared(task, answers(ref_docs, ref_docs), answers(ckpt_docs, ckpt_docs), tmp_path)
    rows, m = result["details"], result["metrics"]
    assert [r["first_diff_token"] for r in rows] == [1, 1, 1]
    assert [r["divergence"] for r in rows] == [
        "near tie at token 1",
        "inside the reference's top-5 at token 1",
        "outside the reference's top-5 at token 1",
    ]
    assert [r.get("near_tie") for r in rows] == [True, False, False]
    assert rows[0]["ref_logp_gap"] == pytest.approx(0.30, abs=1e-6)
    assert rows[2]["ckpt_token_in_ref_top5"] is False and str(rows[2]["ref_logp_gap"]).startswith(">=")
    assert m["near_ties"] == 1 and m["diverged_outside_top5"] == 1
    failed = {c["name"] for c in result["checks"] if not c["passed"]}
    assert failed == {"diverged_outside_top5"} and result["status"] == "fail"


def test_a_prompt_whose_answer_moves_with_the_batch_is_marked_on_its_side_with_both_answers(tmp_path):
    task = smoke(tmp_path, [8, 8, 8, 8])
    same = [document([1, 2, 3]) for _ in range(4)]
    moved = [document([1, 2, 3]), document([1, 4, 5]), document([1, 2, 3]), document([6])]
    result = compared(task, answers(same, same), answers(same, moved), tmp_path)
    rows, m = result["details"], result["metrics"]
    assert [bool(r.get("ckpt_batch_sensitive")) for r in rows] == [False, True, False, True]
    assert not any(r.get("ref_batch_sensitive") for r in rows)
    assert rows[1]["ckpt_answer"] == "bcd" and rows[1]["ckpt_answer_in_batch"] == "bef"
    # The answers compared and shown are those decoded alone: identical here.
    assert m["identical"] == 4 and m["answers_compared"].startswith("decoded alone")
    assert (m["ref_batch_sensitive"], m["ckpt_batch_sensitive"]) == (0, 2)
    assert m["batch_sensitivity_p"] == pytest.approx(0.5)  # 2 discordant prompts, both one way
    # A side decoded in its batches only (streamed) has no count, and says why.
    result = compared(task, answers(same, same), answers(moved, None), tmp_path)
    assert result["metrics"]["ckpt_batch_sensitive"] is None
    assert "only" in result["null_reasons"]["ckpt_batch_sensitive"]
    assert result["metrics"]["answers_compared"].startswith("decoded in batches")


def test_survival_rests_on_exactly_the_prompts_whose_budget_reaches_n(tmp_path):
    """Two prompts of budget 8 that part early are no evidence about 32 tokens: survival_32 rests on the one
    prompt that could reach 32 (today's rule left a short prompt out only when it did not part)."""
    task = smoke(tmp_path, [8, 8, 32, 16], lengths="[4, 8, 32]")
    ref = [document([1, 2, 3, 4, 5, 6, 7, 8]), document([1, 2, 3]), document([1] * 32), document([2] * 16)]
    ckpt = [
        document([1, 9, 3, 4, 5, 6, 7, 8]),
        document([1, 2, 3]),
        document([1] * 32),
        document([2] * 5 + [3]),
    ]
    result = compared(task, answers(ref, ref), answers(ckpt, ckpt), tmp_path)
    m = result["metrics"]
    assert (m["survival_4_n"], m["survival_8_n"], m["survival_32_n"]) == (4, 4, 1)
    # At 4: the first parts at token 1; the second ends identically before 4; the last parts at token 5.
    assert m["survival_4"] == pytest.approx(3 / 4)
    assert m["survival_8"] == pytest.approx(2 / 4)
    assert m["survival_32"] == 1.0


def test_every_configured_survival_length_can_be_thresholded(tmp_path):
    """A `--thresholds` bound on `survival_64` of a spec whose lengths are [4, 64] is taken (today only 8, 16
    and 32 could be named), judged on the figure, and a name smoke does not report is still refused."""
    spec = tmp_path / "smoke.toml"
    spec.write_text(spec_text([64] * 10, lengths="[4, 64]"), encoding="utf-8")
    bound = {"smoke": {"survival_64_lower95": {"min": 0.5}}}
    (task,) = build_tasks(["smoke"], RunContext(), thresholds=bound, specs={"smoke": spec})
    assert task.spec.thresholds["survival_64_lower95"].min == 0.5
    ref = [document([1] * 64)] * 10
    result = compared(task, answers(ref, ref), answers(ref, ref), tmp_path)
    check = next(c for c in result["checks"] if c["name"] == "survival_64_lower95")
    assert check["passed"] and check["value"] == result["metrics"]["survival_64_lower95"] > 0.5
    with pytest.raises(InputError, match="reports no such metric"):
        build_tasks(["smoke"], RunContext(), thresholds={"smoke": {"survivor_64": {"min": 0.5}}})
