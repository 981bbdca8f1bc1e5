"""A reference's greedy answers forced through a side (teacher forcing): at every answer token, what the side
would choose, fed the reference's answer so far.

Greedy decoding is deterministic: a candidate's greedy answer equals the reference's for as long as, fed the
reference's answer so far, its most probable token is the reference's next token. So one forward of each
prompt with the reference's answer (`ForcedSequence`) tells where the candidate would part from it, how much
it prefers its own token there, the log-prob it gives every reference token and the KLD along the answer, for
every prompt at once: the shape of a `ppl` window, so that a streamed side runs these sequences in the same
pass over its layers as `ppl`'s windows (`pass_sequences`, `visitor`). Only a prompt that parts needs the
candidate's own decoding, from there on (`Continuations`).

Both sides are forced, the reference too (`ForcedReference`): its rows, reduced as they come to the compact
form a recording keeps (top-k, the tail's mass, seeded samples of the tail, `compact_rows`), are what the
candidate's are compared with (`ForcedAtReference`: its log-probs at the ids the reference kept), so that a
forward is compared with a forward of the same arithmetic, and a replayed recording gives the same bits.

Decoding and a forced forward do not run the same arithmetic (one token at a time over a cache, against the
whole sequence at once): where two tokens' logits lie within a few units of the logits' last place, the two
paths may rank them differently. A step where the reference's own forced choice is not the token it decoded is
such a tie of the reference's; the candidate agreeing with the reference's forced choice there is no
divergence of its own (`divergences`). A candidate step whose gap is within the logits' resolution
(`resolution`) is marked as such: its decoding may choose either token.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from evalsuite.backends.c_heap import release_freed_memory
from evalsuite.backends.layer_pass import PassSequence, QuietVisitor, observe_alone
from evalsuite.errors import InputError
from evalsuite.observation import Observation
from evalsuite.observers.compact_window_logits import joined_window_parts, save_window_part, window_part
from evalsuite.observers.greedy_answers import (
    ANSWERS_LABEL,
    PROMPTS,
    answer_document,
    answers_observation,
    batches,
    decoded,
    model_inputs,
)
from evalsuite.observers.kld_detail import TOP_K_AGREEMENT, top_hits_recorded
from evalsuite.observers.window_logits import RecordOptions, compact_rows, log_softmax64
from evalsuite.run_folder import write_atomic
from evalsuite.task import Inputs, Progress
from evalsuite.token_ranks import ranked_top

if TYPE_CHECKING:
    from evalsuite.backends import Backend
    from evalsuite.backends.layer_pass import LayerVisitor
    from evalsuite.backends.streamed import StreamedBackend, WindowCall

# The labels under which a candidate's observations find the reference's forced rows and its own.
FORCED_REFERENCE_LABEL = "forced-ref"
FORCED_LABEL = "forced"
# Bits of the significand of each logits dtype (the implicit one included): its resolution at a value.
_SIGNIFICAND_BITS = {"bfloat16": 8, "float16": 11, "float32": 24, "float64": 53}


@dataclass(frozen=True)
class ForcedSequence:
    """One prompt with the reference's answer after it: the rows at `positions` predict the answer's tokens
    (`targets`), each given the prompt and the answer before it."""

    key: str
    ids: list[int]
    prompt_length: int
    extra: dict[str, Any] | None

    @property
    def targets(self) -> list[int]:
        return self.ids[self.prompt_length :]

    @property
    def positions(self) -> torch.Tensor:
        return torch.arange(self.prompt_length - 1, len(self.ids) - 1)

    def pass_sequence(self) -> PassSequence:
        ids = torch.tensor(self.ids, dtype=torch.long)
        extra = None if not self.extra else model_inputs(self.ids, self.extra, self.prompt_length)
        return PassSequence(self.key, ids, extra)


def forced_sequences(inputs: Inputs) -> list[ForcedSequence]:
    """Each prompt of a task's inputs (`PROMPTS`) with the reference's answer to it (the observation consumed
    under `ANSWERS_LABEL`)."""
    observed = inputs.get("observed") or {}
    if ANSWERS_LABEL not in observed:
        raise InputError("forcing the reference's answers needs them observed first")
    answers = observed[ANSWERS_LABEL]
    tokens, offsets = answers.arrays["tokens"], answers.arrays["offsets"]
    prompts = inputs[PROMPTS]
    if len(offsets) != len(prompts) + 1:
        raise InputError(f"the reference answered {len(offsets) - 1} prompts, not {len(prompts)}")
    out = []
    for i, prompt in enumerate(prompts):
        ids = list(prompt["ids"]) + tokens[offsets[i] : offsets[i + 1]].tolist()
        digest = hashlib.sha256(json.dumps(ids).encode() + str(prompt.get("extra_sha256", "")).encode())
        out.append(
            ForcedSequence(f"forced:{digest.hexdigest()}", ids, len(prompt["ids"]), prompt.get("extra"))
        )
    return out


def resolution(value: np.ndarray, dtype: str) -> np.ndarray:
    """The spacing of `dtype`'s numbers at `value` (one unit in the last place): how close two logits may be
    before the arithmetic of a forward, not the model, decides their order."""
    bits = _SIGNIFICAND_BITS.get(dtype, 24)
    magnitude = np.maximum(np.abs(np.asarray(value, dtype=np.float64)), np.finfo(np.float64).tiny)
    return np.exp2(np.floor(np.log2(magnitude)) - (bits - 1))


class _Forced:
    """Base of the two forced observers: each sequence forwarded on its own (no padding: padding changes the
    arithmetic), or in a streamed side's shared pass; its rows reduced as they come (`reduce`) and saved per
    sequence, so that an interrupted observation resumes at the next one."""

    name: str
    what: str

    def __init__(self, record: RecordOptions, full_steps: int, task: str = "") -> None:
        self.record_options = record
        self.full_steps = full_steps
        # Named for its task: a recording holds one observation per name, and two tasks force answers.
        if task:
            self.name = f"{task}-{type(self).name}"

    def identity(self) -> dict[str, Any]:
        return {"record": self.record_options.model_dump(mode="json"), "full_steps": self.full_steps}

    def reduce(self, index: int, logits: torch.Tensor, sequence: ForcedSequence, inputs: Inputs) -> dict:
        """One sequence's arrays from its logit rows."""
        raise NotImplementedError

    def pass_sequences(self, inputs: Inputs) -> list[PassSequence]:
        """The sequences this observation runs in a streamed side's shared layer pass."""
        return [s.pass_sequence() for s in forced_sequences(inputs)]

    def observe(self, backend: Backend, inputs: Inputs, folder: Path, progress: Progress) -> Observation:
        from evalsuite.backends.streamed import StreamedBackend

        sequences = forced_sequences(inputs)
        if isinstance(backend, StreamedBackend):
            passing = [s.pass_sequence() for s in sequences]
            return observe_alone(self.visitor(backend, inputs, folder), backend, passing, folder, progress)
        step = progress(self.what, len(sequences))

        def logits_of(i: int) -> torch.Tensor:
            s = sequences[i]
            return backend.sequence_logits(model_inputs(s.ids, s.extra, s.prompt_length), s.positions)

        return self.observed(backend, inputs, folder, logits_of, step)

    def visitor(self, backend: StreamedBackend, inputs: Inputs, folder: Path) -> LayerVisitor:
        """This observation made during a shared streamed pass: the model's head on each sequence's last
        layer output, at the answer's positions."""
        return _ForcedVisitor(self, backend, inputs, folder)

    def observed(self, backend: Any, inputs: Inputs, folder: Path, logits_of: Any, step: Any) -> Observation:
        """The observation from each sequence's logits (`logits_of(i)`), reducing those not yet saved."""
        sequences = forced_sequences(inputs)
        for i, sequence in enumerate(sequences):
            if not window_part(folder, i).is_file():
                logits = logits_of(i).float().cpu()
                if tuple(logits.shape) != (len(sequence.targets), backend.vocab_size):
                    raise InputError(
                        f"the model returned logits of shape {tuple(logits.shape)} for an answer of "
                        f"{len(sequence.targets)} tokens"
                    )
                save_window_part(folder, i, self.reduce(i, logits, sequence, inputs))
                # Each answer's vocabulary-wide temporaries handed back (`WindowLogits.record`): an answer
                # of a few dozen tokens makes them below glibc's mmap threshold, in the heaps.
                del logits
                release_freed_memory()
            step()
        arrays = joined_window_parts(folder, len(sequences)) if sequences else {}
        lengths = [len(s.targets) for s in sequences]
        arrays["offsets"] = np.cumsum([0, *lengths]).astype(np.int64)
        arrays["full_offsets"] = np.cumsum([0, *(min(self.full_steps, n) for n in lengths)]).astype(np.int64)
        meta = {
            "vocab_size": backend.vocab_size,
            "logits_dtype": str(getattr(backend, "logits_dtype", "bfloat16")),
            "answers_sha256": _answers_sha256(sequences),
            "execution": backend.describe(),
            "top_k": self.record_options.top_k,
            "tail_samples": self.record_options.tail_samples,
        }
        return Observation(name=self.name, meta=meta, arrays=arrays)

    def _full(self, lp: torch.Tensor) -> np.ndarray:
        return np.ascontiguousarray(lp[: self.full_steps].float().numpy())


def _answers_sha256(sequences: Sequence[ForcedSequence]) -> str:
    digest = hashlib.sha256()
    for s in sequences:
        digest.update(s.key.encode())
    return digest.hexdigest()


class _ForcedVisitor(QuietVisitor):
    def __init__(self, observer: _Forced, backend: StreamedBackend, inputs: Inputs, folder: Path) -> None:
        self.observer, self.backend, self.inputs, self.folder = observer, backend, inputs, folder

    def finish(self, final: list[torch.Tensor], calls: list[WindowCall]) -> Observation:
        sequences = forced_sequences(self.inputs)

        def logits_of(i: int) -> torch.Tensor:
            return self.backend.head_logits(final[i], calls[i], sequences[i].positions)

        return self.observer.observed(self.backend, self.inputs, self.folder, logits_of, lambda: None)


class ForcedReference(_Forced):
    """Observer of the reference: its own answers forced through it, each row reduced to the compact form a
    recording keeps (`compact_rows`, seeded per sequence), with its ranked top tokens, the log-prob of the
    token it decoded, its largest logit, and the full rows of the first `full_steps` tokens."""

    # Its recording is the observation itself: a replay plans it under the key it was made under.
    records_itself = True

    name = "forced-answers-compact"
    what = "forced answers"

    def reduce(self, index: int, logits: torch.Tensor, sequence: ForcedSequence, inputs: Inputs) -> dict:
        opts = self.record_options
        seed = hashlib.sha256(f"{opts.seed}:{sequence.key}".encode()).digest()[:8]
        generator = torch.Generator().manual_seed(int.from_bytes(seed, "little") >> 1)
        lp = log_softmax64(logits)
        targets = torch.tensor(sequence.targets, dtype=torch.long)
        ranked, _ = ranked_top(lp.numpy(), min(TOP_K_AGREEMENT, lp.shape[-1]))
        arrays = {k: v.numpy() for k, v in compact_rows(lp, opts, generator).items()}
        arrays.update(
            ranked=ranked.astype(np.int32),
            target_logp=lp.gather(1, targets[:, None])[:, 0].numpy(),
            top_logit=logits.amax(dim=-1).double().numpy(),
            full_logp=self._full(lp),
        )
        return arrays

    def record(self, obs: Observation, folder: Path) -> Observation:
        """The observation is compact already: it is its own recording."""
        return Observation(name=obs.name, key=obs.key, meta=dict(obs.meta), arrays=dict(obs.arrays))


class ForcedAtReference(_Forced):
    """Observer of the candidate, given the reference's answers and its `ForcedReference` rows: per answer
    token its log-probs at the ids the reference kept (`at_top`, `at_tail`), its ranked top tokens and their
    log-probs, the log-prob of the reference's token, its largest logit, whether some token is most probable
    on both sides, ties included (`same_top`), the top-K agreement, and the full rows of the first
    `full_steps` tokens."""

    name = "forced-answers-at-reference"
    what = "forced answers at the reference's ids"

    def reduce(self, index: int, logits: torch.Tensor, sequence: ForcedSequence, inputs: Inputs) -> dict:
        ref = _reference_rows(inputs)
        start, stop = int(ref.arrays["offsets"][index]), int(ref.arrays["offsets"][index + 1])
        if stop - start != len(sequence.targets):
            raise InputError("the reference's forced rows are not those of its answers")
        a = {k: ref.arrays[k][start:stop] for k in ("top_ids", "top_logp", "tail_ids")}
        lp = log_softmax64(logits)
        targets = torch.tensor(sequence.targets, dtype=torch.long)
        ranked, ranked_logp = ranked_top(lp.numpy(), min(TOP_K_AGREEMENT, lp.shape[-1]))
        at_top = lp.gather(1, torch.from_numpy(a["top_ids"]).long())
        on_top = (at_top == lp.amax(dim=-1, keepdim=True)).numpy()
        return {
            "at_top": at_top.float().numpy(),
            "at_tail": lp.gather(1, torch.from_numpy(a["tail_ids"]).long()).float().numpy(),
            "ranked": ranked.astype(np.int32),
            "ranked_logp": ranked_logp,
            "target_logp": lp.gather(1, targets[:, None])[:, 0].numpy(),
            "top_logit": logits.amax(dim=-1).double().numpy(),
            "same_top": np.any(on_top & (a["top_logp"] == a["top_logp"][:, :1]), axis=1),
            "top_hits": top_hits_recorded(a["top_ids"], a["top_logp"], lp, ranked[:, : ranked.shape[1]]),
            "full_logp": self._full(lp),
        }


def _reference_rows(inputs: Inputs) -> Observation:
    observed = inputs.get("observed") or {}
    if FORCED_REFERENCE_LABEL not in observed:
        raise InputError("the candidate's forced answers need the reference's, observed first")
    return observed[FORCED_REFERENCE_LABEL]


@dataclass(frozen=True)
class PromptDivergence:
    """Where a candidate's greedy answer parts from the reference's, as forcing tells it.

    `step`: the first answer token the candidate would not choose (None: it chooses every one); `chosen`: the
    token it would choose there; `gap`: how much it prefers that token to the reference's (nats);
    `below_resolution`: the gap lies within the logits' resolution, so its own decoding may choose either;
    `reference_ties`: steps before `step` (or anywhere, without one) where the reference's own forced choice
    is not the token it decoded, and the candidate agreed with the forced choice; `fragile`: steps before
    `step` where the candidate chooses the reference's token by no more than its logits' resolution over
    the next token, where its own decoding may part instead."""

    step: int | None
    chosen: int | None
    gap: float | None
    below_resolution: bool
    reference_ties: tuple[int, ...]
    fragile: tuple[int, ...] = ()


def path_noise(answers: Observation, ref: Observation) -> float:
    """How far the two paths' log-probs lie apart on the reference itself: the largest difference, over every
    answer token, between the log-prob its decoding gave the token it chose and the one its forced forward
    gives it (nats). Two tokens whose log-probs lie within twice that of each other may be ranked either way
    by the other path."""
    decoded = answers.arrays["top_logp"][:, 0].astype(np.float64)
    forced = ref.arrays["target_logp"].astype(np.float64)
    if decoded.shape != forced.shape:
        raise InputError("the reference's forced rows are not those of its answers")
    return float(np.max(np.abs(decoded - forced))) if len(forced) else 0.0


def divergences(ref: Observation, ckpt: Observation, noise: float = 0.0) -> list[PromptDivergence]:
    """Each prompt's `PromptDivergence` from both sides' forced rows (`ForcedReference`,
    `ForcedAtReference`); a preference within the logits' resolution, or within twice the two paths'
    difference on the reference (`noise`, `path_noise`), is a near tie its decoding may break either way."""
    a, c = ref.arrays, ckpt.arrays
    offsets = a["offsets"]
    if not np.array_equal(offsets, c["offsets"]):
        raise InputError("the sides were forced along different answers")
    dtype = str(ckpt.meta.get("logits_dtype", "bfloat16"))
    best_ckpt = c["ranked_logp"][:, 0]
    agrees = c["target_logp"] >= best_ckpt
    ref_agrees = a["target_logp"] >= a["top_logp"][:, 0]
    same_choice = c["ranked"][:, 0] == a["ranked"][:, 0]
    margin = (
        best_ckpt - c["ranked_logp"][:, 1]
        if c["ranked_logp"].shape[1] > 1
        else np.full_like(best_ckpt, np.inf)
    )
    tolerance = np.maximum(resolution(c["top_logit"], dtype), 2 * noise)
    fragile_rows = agrees & (margin <= tolerance)
    out = []
    for i in range(len(offsets) - 1):
        ties: list[int] = []
        fragile: list[int] = []
        found = None
        for row in range(int(offsets[i]), int(offsets[i + 1])):
            if agrees[row]:
                if fragile_rows[row]:
                    fragile.append(row - int(offsets[i]))
                continue
            if not ref_agrees[row] and same_choice[row]:
                ties.append(row - int(offsets[i]))
                continue
            found = row
            break
        if found is None:
            out.append(PromptDivergence(None, None, None, False, tuple(ties), tuple(fragile)))
            continue
        gap = float(best_ckpt[found] - c["target_logp"][found])
        near = gap <= float(tolerance[found])
        chosen = int(c["ranked"][found, 0])
        out.append(PromptDivergence(found - int(offsets[i]), chosen, gap, near, tuple(ties), tuple(fragile)))
    return out


class Continuations:
    """Observer of the candidate: its own greedy answer to each prompt where it parts from the reference's
    (`divergences`), decoded from the prompt, the reference's answer up to the divergence and the candidate's
    token there, in batches of like budgets (`evalsuite.observers.greedy_answers.batches`): its answers are
    decoded again every run, the reference's often replayed, and a batch runs for its largest budget. Where
    it does not part, its answer is the reference's. The observation holds every prompt's answer, as an
    observation of answers does."""

    name = "continuations"
    what = "continuations after a divergence"

    def __init__(self, top_k: int, batch: int, task: str = "") -> None:
        self.top_k, self.batch = top_k, batch
        if task:
            self.name = f"{task}-{type(self).name}"

    def identity(self) -> dict[str, Any]:
        return {"top_k": self.top_k, "batch": self.batch, "batches": "by-budget"}

    def observe(self, backend: Backend, inputs: Inputs, folder: Path, progress: Progress) -> Observation:
        observed = inputs.get("observed") or {}
        answers = observed[ANSWERS_LABEL]
        noise = path_noise(answers, observed[FORCED_REFERENCE_LABEL])
        parts = divergences(observed[FORCED_REFERENCE_LABEL], observed[FORCED_LABEL], noise)
        tokens, offsets = answers.arrays["tokens"], answers.arrays["offsets"]
        prompts = inputs[PROMPTS]
        stops = set(_stop_tokens(backend))
        todo: list[int] = []
        continued: list[dict[str, Any]] = []
        for i, (prompt, part) in enumerate(zip(prompts, parts, strict=True)):
            if part.step is None or part.chosen in stops or part.step + 1 >= int(prompt["max_new_tokens"]):
                continue
            head = [*tokens[offsets[i] : offsets[i] + part.step].tolist(), part.chosen]
            todo.append(i)
            continued.append(
                {
                    "ids": list(prompt["ids"]) + head,
                    "extra": prompt.get("extra"),
                    "prompt_length": len(prompt["ids"]),
                    "max_new_tokens": int(prompt["max_new_tokens"]) - len(head),
                }
            )
        step = progress(self.what, len(continued))
        groups = batches(continued, self.batch, by_budget=True)
        docs, _ = decoded(backend, continued, groups, folder, self.top_k, 0, step)
        after = dict(zip(todo, docs, strict=True))
        noise = self._path_noise(backend, continued, docs, folder)
        documents = []
        for i, part in enumerate(parts):
            ref_tokens = tokens[offsets[i] : offsets[i + 1]].tolist()
            ref_top = answers.arrays["top_ids"][offsets[i] : offsets[i + 1]]
            ref_logp = answers.arrays["top_logp"][offsets[i] : offsets[i + 1]]
            if part.step is None:
                documents.append(answer_document(backend.tokenizer, ref_tokens, ref_top, ref_logp))
                continue
            head = [*ref_tokens[: part.step], int(part.chosen)]
            tail = after.get(i)
            own = head + (tail["tokens"] if tail else [])
            # The steps the candidate was forced along keep the reference's ranks (its own are the forced
            # rows); the continuation's steps are its own.
            top = (
                np.concatenate([ref_top[: len(head)], np.asarray(tail["top_ids"]).reshape(-1, self.top_k)])
                if tail
                else ref_top[: len(head)]
            )
            logp = (
                np.concatenate([ref_logp[: len(head)], np.asarray(tail["top_logp"]).reshape(-1, self.top_k)])
                if tail
                else ref_logp[: len(head)]
            )
            documents.append(answer_document(backend.tokenizer, own, top, logp))
        meta = {"execution": backend.describe(), "continued": todo, "path_noise": noise}
        return answers_observation(self.name, documents, None, self.top_k, meta)

    @staticmethod
    def _path_noise(
        backend: Any, continued: list[dict[str, Any]], docs: list[dict[str, Any]], folder: Path
    ) -> float:
        """The candidate's own `path_noise`: how far its decoding's log-prob of each token it decoded after a
        divergence lies from its forced forward's (one forward of each continued prompt with its answer)."""
        saved = folder / "path-noise.json"
        if saved.is_file():
            return float(json.loads(saved.read_text(encoding="utf-8"))["path_noise"])
        items, decoded_logp = [], []
        for prompt, doc in zip(continued, docs, strict=True):
            if not doc["tokens"]:
                continue
            ids = list(prompt["ids"]) + list(doc["tokens"])
            start = len(prompt["ids"])
            inputs = model_inputs(ids, prompt.get("extra"), prompt.get("prompt_length"))
            items.append((inputs, torch.arange(start - 1, len(ids) - 1)))
            decoded_logp.append((np.asarray(doc["top_logp"], dtype=np.float64)[:, 0], doc["tokens"]))
        noise = 0.0
        rows = backend.sequences_logits(items) if items else []
        for logits, (logp, tokens) in zip(rows, decoded_logp, strict=True):
            lp = log_softmax64(logits.float().cpu())
            forced = lp.gather(1, torch.tensor(tokens, dtype=torch.long)[:, None])[:, 0].numpy()
            noise = max(noise, float(np.max(np.abs(forced - logp))))
        write_atomic(saved, json.dumps({"path_noise": noise}))
        return noise


def _stop_tokens(backend: Any) -> list[int]:
    model = getattr(backend, "model", None)
    config = getattr(model, "generation_config", None)
    eos = getattr(config, "eos_token_id", None)
    if eos is None:
        return []
    return [eos] if isinstance(eos, int) else list(eos)


def kld_resolution_note(dtype: str) -> str:
    """How the report words a divergence within the logits' resolution."""
    bits = _SIGNIFICAND_BITS.get(dtype, 24)
    return f"a near tie within {dtype}'s resolution (2^-{bits - 1} of the logit): decoding may choose either"


__all__ = [
    "FORCED_LABEL",
    "FORCED_REFERENCE_LABEL",
    "Continuations",
    "ForcedAtReference",
    "ForcedReference",
    "ForcedSequence",
    "PromptDivergence",
    "divergences",
    "forced_sequences",
    "kld_resolution_note",
    "resolution",
]
