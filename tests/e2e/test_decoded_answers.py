"""`smoke` and `vision` compare answers as each side decodes them (`evalsuite.observers.greedy_answers`,
`evalsuite.tasks.answer_pairs`): each side's shown answer is its own greedy answer decoded alone by
Transformers' `generate`, or the row is marked batch-sensitive with both answers; a near tie is only a
divergence the reference's own decoding ranked within `near_tie` at that step, inside its top-5; survival at N
rests on exactly the prompts whose budget reaches N; a candidate built to part at a known token is caught at
that token; and a streamed run of `ppl,smoke,vision` skips nothing and gives the loaded run's answers in the
configuration it decodes (its batches), reading each decoder layer once for the shared pass plus once per
decoding step."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from evalsuite.backends import load_backend
from evalsuite.backends.options import BackendOptions
from evalsuite.contract.observation import Observation
from evalsuite.contract.spec import default_spec_path, load_spec
from evalsuite.fixtures import TINY_BF16, TINY_W4A8
from evalsuite.protocol.side import open_side
from evalsuite.stats import metrics
from evalsuite.tasks.answer_pairs import DIVERGENCE_MARK
from evalsuite.tasks.smoke import SmokeSpec, prompt_ids
from evalsuite.tasks.vision._reading import as_reading
from tests.conftest import Run, copy_checkpoint, edit_tensors, run_pair, smoke_subset_spec, tiny_spec_args

SHIPPED = default_spec_path("smoke")


def short_vision_spec(folder: Path) -> Path:
    """The shipped vision spec with short answers and two cases beside the single image (the slicing one and
    the label to read): every path of the task, at a fraction of its decoding steps."""
    text = SHIPPED.with_name("vision.toml").read_text(encoding="utf-8")
    head, *cases = text.split("\n[[cases]]")
    head = head.replace("max_new_tokens = 40", "max_new_tokens = 8")
    kept = [c for c in cases if 'name = "slices"' in c or 'name = "ocr"' in c]
    path = folder / "vision-short.toml"
    path.write_text(head + "".join("\n[[cases]]" + c for c in kept), encoding="utf-8")
    return path


def observation(run: Run, role: str, name: str) -> Observation:
    (folder,) = (run.out / "observations").glob(f"{role}-{name}-*")
    return Observation.load(folder)


def generated_alone(folder: Path, spec_path: Path) -> list[list[int]]:
    """Each prompt's greedy answer decoded alone by the model's own `generate` (a batch of one, no padding),
    with a plain generation config: the answer a single request gets, made without evalsuite's decoding
    code (the model is loaded as users load it)."""
    from transformers import GenerationConfig

    spec = load_spec(SmokeSpec, spec_path)
    side = open_side("ckpt", folder, BackendOptions())
    backend = load_backend(side.checkpoint, side.options)
    model = backend.model
    eos = model.generation_config.eos_token_id
    stops = [eos] if isinstance(eos, int) else list(eos or [])
    try:
        out: list[list[int]] = []
        for prompt in spec.prompts:
            ids = torch.tensor([prompt_ids(side, prompt)])
            config = GenerationConfig(
                do_sample=False,
                max_new_tokens=prompt.max_new_tokens,
                eos_token_id=stops or None,
                pad_token_id=stops[0] if stops else 0,
            )
            with torch.inference_mode():
                made = model.generate(
                    input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config
                )
            new = made[0, ids.shape[1] :].tolist()
            ends = [i for i, t in enumerate(new) if t in stops]
            out.append(new[: ends[0] + 1] if ends else new)
        return out
    finally:
        backend.close()


def shown_tokens(obs: Observation) -> list[list[int]]:
    tokens, offsets = obs.arrays["tokens"], obs.arrays["offsets"]
    return [tokens[offsets[i] : offsets[i + 1]].tolist() for i in range(len(offsets) - 1)]


def answers_as_decoded(run: Run, spec_path: Path, folders: dict[str, Path]) -> list[str]:
    """What the issue asks of a loaded run's `smoke` rows, checked against each side decoded alone by
    Transformers: each side's shown answer is that answer, token for token, or the row is marked
    batch-sensitive on that side with its answer in the batch beside it; the divergence is where the two
    decoded answers first differ; a near tie only where the reference's own gap is below `near_tie`, inside
    its top-5; the labels agree with the verdict's count; survival at N over exactly the prompts whose budget
    reaches N. Returns the ids of batch-sensitive rows."""
    spec = load_spec(SmokeSpec, spec_path)
    smoke = run.task("smoke")
    rows, m = smoke["details"], smoke["metrics"]
    rows = [r for r in rows if "table" not in r]
    assert len(rows) == len(spec.prompts)
    answers = {}
    for side in ("ref", "ckpt"):
        obs = observation(run, side, "smoke-answers")
        assert obs.meta["configuration"]["decoded"] == ["alone", "batch"], obs.meta["configuration"]
        real = generated_alone(folders[side], spec_path)
        assert shown_tokens(obs) == real, side  # the shown answers are the answers alone
        answers[side] = real
    sensitive = []
    near_tie = spec.generation.near_tie
    for row, prompt, ref, ckpt in zip(rows, spec.prompts, answers["ref"], answers["ckpt"], strict=True):
        assert row["id"] == prompt.id
        d = metrics.first_divergence(ref, ckpt)
        assert row["first_diff_token"] == d and row["identical"] == (d is None), row["id"]
        if row.get("ref_batch_sensitive") or row.get("ckpt_batch_sensitive"):
            sensitive.append(row["id"])
            for side in ("ref", "ckpt"):
                if row.get(f"{side}_batch_sensitive"):
                    assert row[f"{side}_answer_in_batch"] != row[f"{side}_answer"].replace(
                        DIVERGENCE_MARK, ""
                    )
        if d is None:
            continue
        gap, inside = row["ref_logp_gap"], row["ckpt_token_in_ref_top5"]
        if row.get("near_tie"):
            assert inside and isinstance(gap, float) and gap < near_tie, row
            assert row["divergence"].startswith("near tie"), row
        elif inside:
            assert gap >= near_tie and "inside the reference's top-5" in row["divergence"], row
        else:
            assert "outside the reference's top-5" in row["divergence"], row
    assert m["near_ties"] == sum(bool(r.get("near_tie")) for r in rows)
    assert m["diverged_outside_top5"] == sum(r["ckpt_token_in_ref_top5"] is False for r in rows)
    for n in spec.survival.lengths:
        reach = [r for r, p in zip(rows, spec.prompts, strict=True) if p.max_new_tokens >= n]
        assert m[f"survival_{n}_n"] == len(reach), n
        kept = sum(r["first_diff_token"] is None or r["first_diff_token"] >= n for r in reach)
        assert m[f"survival_{n}"] == (kept / len(reach) if reach else m[f"survival_{n}"]), n
    for side in ("ref", "ckpt"):
        assert m[f"{side}_batch_sensitive"] == sum(bool(r.get(f"{side}_batch_sensitive")) for r in rows)
    return sensitive


def test_each_sides_shown_answer_is_its_own_answer_decoded_alone(tiny_pair, tmp_path):
    """On the tiny pair loaded, a subset of the shipped prompts (the tiny model's answers mean nothing; the
    mechanism is what is checked): the rows say what each side decoded alone, by Transformers' own
    `generate`, and mark where the batch moves an answer."""
    spec = smoke_subset_spec(tmp_path, 12)
    run = run_pair(
        tiny_pair[TINY_W4A8], tiny_pair[TINY_BF16], tmp_path / "run", "smoke", "--spec", f"smoke={spec}"
    )
    assert run.cli.returncode in (0, 1), run.cli.stderr
    answers_as_decoded(run, spec, {"ref": tiny_pair[TINY_BF16], "ckpt": tiny_pair[TINY_W4A8]})
    m = run.metrics("smoke")
    assert m["answers_compared"].startswith("decoded alone"), m["answers_compared"]
    assert 0 <= m["batch_sensitivity_p"] <= 1


def swap_rows(folder: Path, a: int, b: int) -> None:
    """The head's rows of tokens `a` and `b` swapped (the model then scores one as the other)."""

    def edit(tensors: dict) -> None:
        (name,) = [n for n in tensors if n.endswith("lm_head.weight")]
        w = tensors[name].clone()
        w[[a, b]] = w[[b, a]]
        tensors[name] = w

    edit_tensors(folder, edit)


def test_a_candidate_built_to_part_at_a_known_token_is_caught_at_that_token(tiny_pair, tiny_run, tmp_path):
    answers = observation(tiny_run, "ref", "smoke-answers")
    refs = shown_tokens(answers)
    spec_args = tiny_spec_args()
    spec = load_spec(SmokeSpec, Path(spec_args[1].removeprefix("smoke=")))
    side = open_side("ref", tiny_pair[TINY_BF16], BackendOptions())
    prompt_tokens = {t for p in spec.prompts for t in prompt_ids(side, p)}
    # The two tokens the reference answers with most often, neither in any prompt (the head is not tied to
    # the embeddings here, but a prompt must not read what was edited): swapped in the candidate's head,
    # each is chosen where the reference chose the other, and nothing else changes, so its decoded answer
    # parts from the reference's exactly at the first of them.
    counts = np.bincount(np.concatenate([np.asarray(r) for r in refs]))
    order = [int(t) for t in np.argsort(-counts, kind="stable") if int(t) not in prompt_tokens]
    a, b = order[0], order[1]
    candidate = copy_checkpoint(tiny_pair[TINY_BF16], tmp_path / "swapped")
    swap_rows(candidate, a, b)
    run = run_pair(candidate, tiny_pair[TINY_BF16], tmp_path / "run", "smoke", *spec_args)
    assert run.cli.returncode in (0, 1), run.cli.stderr
    rows = run.task("smoke")["details"]
    top_ids, top_logp, offsets = (answers.arrays[k] for k in ("top_ids", "top_logp", "offsets"))
    caught = 0
    for i, (row, ref) in enumerate(zip(rows, refs, strict=True)):
        expected = next((j for j, t in enumerate(ref) if t in (a, b)), None)
        # Where the reference chose its token over a or b by an exact tie of their logits, the lowest id wins,
        # and the swap may move which one that is: the candidate may part there instead.
        tied = [
            j
            for j in range(len(ref))
            for t, lp in zip(top_ids[offsets[i] + j], top_logp[offsets[i] + j], strict=True)
            if t in (a, b) and lp == top_logp[offsets[i] + j][0]
        ]
        assert row["first_diff_token"] in {expected, *tied}, (row["id"], ref, row)
        caught += expected is not None
    assert caught >= 10  # the swap shows in many prompts, each at its own token


def in_batches(run: Run, side: str) -> list[str]:
    """A loaded side's answers as decoded in its batches: its shown answer where the row does not mark it
    batch-sensitive, else the answer in the batch the row gives."""
    rows = [r for r in run.task("smoke")["details"] if "table" not in r]
    return [
        r[f"{side}_answer_in_batch"]
        if r.get(f"{side}_batch_sensitive")
        else r[f"{side}_answer"].replace(DIVERGENCE_MARK, "")
        for r in rows
    ]


def test_a_streamed_run_of_ppl_smoke_and_vision_skips_nothing_and_equals_the_loaded_run(tiny_pair, tmp_path):
    """A streamed side decodes in its batches only (decoding alone would read every layer once per prompt
    and step): its answers are the loaded run's answers in the same batches, and its batch sensitivity is
    not measured, with the reason. The vision task runs its OCR case too: both runs read the label with the
    same answers (a question about an image is decoded alone either way), hence the same character error
    rates, each that of its answer against the text drawn."""
    spec = smoke_subset_spec(tmp_path)
    args = ("--spec", f"smoke={spec}", "--spec", f"vision={short_vision_spec(tmp_path)}")
    loaded = run_pair(
        tiny_pair[TINY_W4A8], tiny_pair[TINY_BF16], tmp_path / "loaded", "ppl,smoke,vision", *args
    )
    streamed = run_pair(
        tiny_pair[TINY_W4A8],
        tiny_pair[TINY_BF16],
        tmp_path / "streamed",
        "ppl,smoke,vision",
        *args,
        "--stream",
    )
    for run in (loaded, streamed):
        assert run.cli.returncode in (0, 1), run.cli.stderr
    for task in ("ppl", "vision"):
        a, b = loaded.task(task), streamed.task(task)
        assert b["status"] not in ("skipped", "error"), b.get("reason")
        same = {k for k in a["metrics"] if not k.endswith("_execution")}
        assert {k: a["metrics"][k] for k in same} == {k: b["metrics"][k] for k in same}, task
        assert a.get("details") == b.get("details"), task
    smoke = streamed.task("smoke")
    assert smoke["status"] not in ("skipped", "error"), smoke.get("reason")
    rows = [r for r in smoke["details"] if "table" not in r]
    for side in ("ref", "ckpt"):
        assert [r[f"{side}_answer"].replace(DIVERGENCE_MARK, "") for r in rows] == in_batches(loaded, side)
        assert smoke["metrics"][f"{side}_batch_sensitive"] is None
        assert "only" in smoke["null_reasons"][f"{side}_batch_sensitive"]
        config = observation(streamed, side, "smoke-answers").meta["configuration"]
        assert config["decoded"] == ["batch"] and config["batch"] == 32, config
    assert smoke["metrics"]["answers_compared"].startswith("decoded in batches of up to 32")
    # The forced figures do not depend on how the answers were decoded when both runs force the same ones.
    if not any(r.get("ref_batch_sensitive") for r in loaded.task("smoke")["details"]):
        assert smoke["metrics"]["kld_mean"] == loaded.metrics("smoke")["kld_mean"]
    vision = streamed.task("vision")
    m, row = vision["metrics"], next(r for r in vision["details"] if r["case"] == "ocr")
    for side in ("ref", "ckpt"):
        read = metrics.character_error_rate(as_reading(row[f"{side}_answer"]), "KAFKA 7351")
        assert m[f"ocr.{side}_cer"] == read, (side, row)
    assert m["ocr.answer_kld_mean"] >= 0 and m["ocr.vision_cosine"] == 1.0
    # The random model reads nothing: cer_delta is left undefined, with its reason, and not judged.
    assert m["ocr.ref_cer"] > 0.5 and m["ocr.cer_delta"] is None, row
    assert "does not read 'KAFKA 7351'" in vision["null_reasons"]["ocr.cer_delta"]
    assert "ocr.cer_delta" in vision["not_measured"]
    # One read of each layer for the pass every forced and windowed observation rides, plus one per forward
    # of each decoding (each side's answers).
    entries = {e["side"]: e for e in streamed.results["model_loads"]}
    # The process's peak so far, after each load: never falling, so the first load at the largest is where
    # the run's peak was reached.
    peaks = [e["peak_rss_bytes"] for e in streamed.results["model_loads"]]
    assert peaks == sorted(peaks) and peaks[0] > 0, peaks
    for side in ("ref", "ckpt"):
        entry = entries[side]
        assert entry["generation_forwards"] > 0, entry
        assert entry["pass_layer_loads"] == entry["n_layers"], entry
        assert entry["decoder_layer_loads"] == entry["n_layers"] * (1 + entry["generation_forwards"])
        # The side's set-up, and its layer reads: a part of its observations' seconds, never all of them.
        assert entry["load_seconds"] > 0, entry
        assert 0 < entry["layer_read_seconds"] < sum(entry["seconds"].values()), entry
