"""`smoke` and `vision` observe the candidate along the reference's answers
(`evalsuite.observers.forced_answers`): the divergence forcing finds is the one the candidate's own greedy
decoding makes, or a step the report marks as within the logits' resolution; a candidate built to part at a
known token is caught at that token; and a streamed run of `ppl,smoke,vision` skips nothing, gives the loaded
run's answers, divergences and OCR character error rates, and reads each decoder layer once for the shared
pass plus once per decoding step."""

from __future__ import annotations

import tomllib
from pathlib import Path

import numpy as np

from evalsuite import metrics
from evalsuite.backends import load_backend
from evalsuite.backends.options import BackendOptions
from evalsuite.fixtures import TINY_BF16, TINY_W4A8
from evalsuite.observation import Observation
from evalsuite.observers.greedy_answers import batches, generate_batch
from evalsuite.side import open_side
from evalsuite.spec import default_spec_path, load_spec
from evalsuite.tasks.smoke import SmokeSpec, prompt_ids
from evalsuite.tasks.vision._reading import as_reading
from tests.conftest import Run, copy_checkpoint, edit_tensors, run_pair

SHIPPED = default_spec_path("smoke")


def subset_spec(folder: Path, count: int = 12) -> Path:
    """The shipped smoke spec with `count` of its prompts (the first of each category, then in order): the
    same tables, fewer prompts, for runs that check a mechanism rather than the prompt set."""
    text = SHIPPED.read_text(encoding="utf-8")
    head, *blocks = text.split("\n[[prompts]]")
    chosen, seen = [], set()
    parsed = [tomllib.loads("[[prompts]]" + b)["prompts"][0] for b in blocks]
    for i, p in enumerate(parsed):
        if p["category"] not in seen:
            seen.add(p["category"])
            chosen.append(i)
    chosen += [i for i in range(len(blocks)) if i not in chosen][: max(0, count - len(chosen))]
    path = folder / "smoke-subset.toml"
    path.write_text(head + "".join("\n[[prompts]]" + blocks[i] for i in sorted(chosen)), encoding="utf-8")
    return path


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


def own_answers(folder: Path, spec_path: Path, answers: Observation) -> list[list[int]]:
    """The candidate's own greedy answers, decoded for real by the model's `generate`, in the batches the
    reference was decoded in."""
    spec = load_spec(SmokeSpec, spec_path)
    side = open_side("ckpt", folder, BackendOptions())
    prompts = [{"ids": prompt_ids(side, p), "max_new_tokens": p.max_new_tokens} for p in spec.prompts]
    backend = load_backend(side.checkpoint, side.options)
    try:
        out: list[list[int]] = [[] for _ in prompts]
        for members in batches(prompts, spec.generation.batch):
            gens = generate_batch(backend, [prompts[i] for i in members], spec.generation.top_k, 0)
            for i, gen in zip(members, gens, strict=True):
                out[i] = list(gen.tokens)
        return out
    finally:
        backend.close()


def reference_answers(answers: Observation) -> list[list[int]]:
    tokens, offsets = answers.arrays["tokens"], answers.arrays["offsets"]
    return [tokens[offsets[i] : offsets[i + 1]].tolist() for i in range(len(offsets) - 1)]


def test_forcing_finds_the_divergence_the_candidates_own_decoding_makes(tiny_pair, tiny_run):
    smoke = tiny_run.task("smoke")
    answers = observation(tiny_run, "ref", "smoke-answers")
    refs = reference_answers(answers)
    real = own_answers(tiny_pair[TINY_W4A8], SHIPPED, answers)
    agree_real = differ_marked = 0
    for row, ref, own in zip(smoke["details"], refs, real, strict=True):
        decoded = metrics.first_divergence(ref, own)
        forced = row["first_diff_token"]
        assert row["identical"] == (forced is None)
        if decoded == forced:
            agree_real += 1
            continue
        # Where forcing and decoding part at different tokens, the earlier of the two is a step the report
        # marks: the candidate's agreement within its logits' resolution, or its divergence within it.
        first = min(t for t in (decoded, forced) if t is not None)
        marked = {int(s) for s in str(row.get("agreement_within_resolution", "")).split(",") if s.strip()}
        marked |= {int(s) for s in str(row.get("reference_ties", "")).split(",") if s.strip()}
        if forced is not None and row.get("within_resolution"):
            marked.add(forced)
        assert first in marked, (row["id"], decoded, forced, row)
        differ_marked += 1
    # The tiny random model's logits lie close together: most prompts part, at the token forcing names.
    assert agree_real >= len(refs) * 0.8, (agree_real, differ_marked)


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
    refs = reference_answers(answers)
    spec = load_spec(SmokeSpec, SHIPPED)
    side = open_side("ref", tiny_pair[TINY_BF16], BackendOptions())
    prompt_tokens = {t for p in spec.prompts for t in prompt_ids(side, p)}
    # The two tokens the reference answers with most often, neither in any prompt (the head is not tied to
    # the embeddings here, but a prompt must not read what was edited): swapped in the candidate's head,
    # each is chosen where the reference chose the other, and nothing else changes.
    counts = np.bincount(np.concatenate([np.asarray(r) for r in refs]))
    order = [int(t) for t in np.argsort(-counts, kind="stable") if int(t) not in prompt_tokens]
    a, b = order[0], order[1]
    candidate = copy_checkpoint(tiny_pair[TINY_BF16], tmp_path / "swapped")
    swap_rows(candidate, a, b)
    run = run_pair(candidate, tiny_pair[TINY_BF16], tmp_path / "run", "smoke")
    assert run.cli.returncode in (0, 1), run.cli.stderr
    rows = run.task("smoke")["details"]
    caught = 0
    for row, ref in zip(rows, refs, strict=True):
        expected = next((i for i, t in enumerate(ref) if t in (a, b)), None)
        assert row["first_diff_token"] == expected, (row["id"], ref, row)
        caught += expected is not None
    assert caught >= 10  # the swap shows in many prompts, each at its own token


def test_a_streamed_run_of_ppl_smoke_and_vision_skips_nothing_and_equals_the_loaded_run(tiny_pair, tmp_path):
    """The vision task runs its OCR case too: both runs read the label with the same answers, hence the same
    character error rates, each that of its answer against the text drawn."""
    spec = subset_spec(tmp_path)
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
    for task in ("ppl", "smoke", "vision"):
        a, b = loaded.task(task), streamed.task(task)
        assert b["status"] not in ("skipped", "error"), b.get("reason")
        same = {k for k in a["metrics"] if not k.endswith("_execution")}
        assert {k: a["metrics"][k] for k in same} == {k: b["metrics"][k] for k in same}, task
        assert a.get("details") == b.get("details"), task
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
    # of each decoding (the reference's answers; the candidate's continuations after a divergence), plus, on
    # the candidate's side, one pass forcing each task's continuations (its decoding paths' difference).
    entries = {e["side"]: e for e in streamed.results["model_loads"]}
    # The process's peak so far, after each load: never falling, so the first load at the largest is where
    # the run's peak was reached.
    peaks = [e["peak_rss_bytes"] for e in streamed.results["model_loads"]]
    assert peaks == sorted(peaks) and peaks[0] > 0, peaks
    continuations = sum(name.endswith("continuations") for name in entries["ckpt"]["observations"])
    for side, passes in (("ref", 1), ("ckpt", 1 + continuations)):
        entry = entries[side]
        assert entry["generation_forwards"] > 0, entry
        assert entry["pass_layer_loads"] == passes * entry["n_layers"], entry
        assert entry["decoder_layer_loads"] == entry["n_layers"] * (passes + entry["generation_forwards"])
        # The side's set-up, and its layer reads: a part of its observations' seconds, never all of them.
        assert entry["load_seconds"] > 0, entry
        assert 0 < entry["layer_read_seconds"] < sum(entry["seconds"].values()), entry
