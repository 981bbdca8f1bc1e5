"""A reference's greedy answers forced through a side (teacher forcing): at every token of the reference's
answer, the side's next-token distribution, fed the reference's answer so far.

What forcing is good for: the per-token KL divergence and log-probs of both sides along the same answer, for
every prompt in one forward each (`ForcedSequence`), the shape of a `ppl` window, so that a streamed side runs
these sequences in the same pass over its layers as `ppl`'s windows (`pass_sequences`, `visitor`). What it is
not: a side's answer. A forward of the whole sequence and a decoding (a token at a time over a cache, in a
batch with padding) do not run the same arithmetic, and a quantized model's INT8 activations round
discontinuously, so the token a forced row ranks first is not always the token the side decodes. Every
answer, pass or divergence a report prints comes from answers the sides decoded
(`evalsuite.observers.greedy_answers`); these rows are labelled as forced wherever they are shown.

Both sides are forced, the reference too (`ForcedReference`): its rows, reduced as they come to the compact
form a recording keeps (top-k, the tail's mass, seeded samples of the tail, `compact_rows`), are what the
candidate's are compared with (`ForcedAtReference`: its log-probs at the ids the reference kept), so that a
forward is compared with a forward of the same arithmetic, and a replayed recording gives the same bits.
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
from evalsuite.contract.observation import Observation
from evalsuite.errors import InputError
from evalsuite.observers.compact_window_logits import joined_window_parts, save_window_part, window_part
from evalsuite.observers.greedy_answers import (
    ANSWERS_LABEL,
    PROMPTS,
    model_inputs,
)
from evalsuite.observers.kld_detail import TOP_K_AGREEMENT, top_hits_recorded
from evalsuite.observers.window_logits import RecordOptions, compact_rows, log_softmax64
from evalsuite.protocol.task import Inputs, Progress
from evalsuite.stats.token_ranks import ranked_top

if TYPE_CHECKING:
    from evalsuite.backends import Backend
    from evalsuite.backends.layer_pass import LayerVisitor
    from evalsuite.backends.streamed import StreamedBackend, WindowCall

# The labels under which a candidate's observations find the reference's forced rows and its own.
FORCED_REFERENCE_LABEL = "forced-ref"
FORCED_LABEL = "forced"


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


__all__ = [
    "FORCED_LABEL",
    "FORCED_REFERENCE_LABEL",
    "ForcedAtReference",
    "ForcedReference",
]
