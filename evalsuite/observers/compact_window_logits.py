"""Long windows' logits reduced as the head makes them: no side keeps a window × vocabulary array.

At a 248 k-token vocabulary one 32 k-token window's logits are 16 GB in bf16. Stored per side, as the
512-token protocol stores its windows' logits, they would fill a disk, while the comparison needs a few
hundred numbers per scored token. So on long windows (`[long_context] head_chunk_rows`) each chunk of logits
the head makes (`ScoredStates.chunks`) is reduced a few rows at a time, in float64, and dropped:
- the reference keeps its compact form, what `evalsuite record` keeps (`compact_rows`: the top-k ids and
  log-probs, the mass beyond them, seeded samples of that tail), and its NLL and top token: its observation
  is its own recording;
- the candidate, observed after it, consumes it and keeps its log-probs at the ids the reference kept, its
  NLL, top token and ranked top tokens.
`compare` estimates KL(ref ‖ ckpt) as against a recording: exact over the reference's top-k, an unbiased
sampled estimate beyond (`metrics.kl_divergence_top_k_tail`), labelled as such in results.json; a live
reference and its recording give the same bits. Lost against full logits on both sides: the
full-vocabulary KLD, the reverse KLD (KL(ckpt ‖ ref) needs the reference's log-probs at the candidate's
ids), and the reuse of a candidate's observation against another reference.

Each window's reduction is saved as it completes: an interrupted observation resumes at the next window.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from evalsuite.backends.c_heap import map_large_allocations
from evalsuite.contract.observation import Observation
from evalsuite.errors import InputError
from evalsuite.files.run_folder import atomic_target
from evalsuite.observers.kld_detail import TOP_K_AGREEMENT, TokenDetail, kld_at_reference, top_hits_recorded
from evalsuite.observers.window_logits import (
    COMPACT_ARRAYS,
    RecordOptions,
    RowScores,
    WindowObserver,
    WindowProtocol,
    compact_rows,
    log_softmax64,
    window_logits_meta,
    window_tensor,
)
from evalsuite.protocol.task import Inputs, Need, Progress

if TYPE_CHECKING:
    from evalsuite.backends import Backend, ChunkedHead
    from evalsuite.backends.chunked_head import ScoredStates

REFERENCE_NAME = "window-logits-compact"
CANDIDATE_NAME = "window-logits-at-reference"
# The label under which the candidate's observer finds the reference's (`Need.consumes`).
REFERENCE_LABEL = "ref"


class _ReducedWindowLogits(WindowObserver):
    """Base of the two observers: each window forwarded with the head left out, its logits made
    `head_rows` positions at a time, reduced `chunk_rows` rows at a time (`reduce`), each window's arrays
    saved as it completes."""

    what: str

    def __init__(self, protocol: WindowProtocol, chunk_rows: int, head_rows: int) -> None:
        super().__init__(protocol)
        self.chunk_rows = chunk_rows
        self.head_rows = head_rows

    def identity(self) -> dict[str, Any]:
        return {"protocol": self.protocol.model_dump(mode="json"), "head_chunk_rows": self.head_rows}

    def reduce(
        self, window: int, blocks: Iterator[tuple[torch.Tensor, torch.Tensor]], inputs: Inputs
    ) -> dict:
        """One window's arrays from its blocks of (logits, true next tokens), in row order."""
        raise NotImplementedError

    def observe(self, backend: Backend, inputs: Inputs, folder: Path, progress: Progress) -> Observation:
        from evalsuite.backends import ChunkedHead

        if not isinstance(backend, ChunkedHead):
            raise InputError(
                f"backend {backend.describe().get('backend', type(backend).__name__)} cannot apply its head "
                "per chunk of positions; set [long_context] head_chunk_rows = 0 to score whole windows"
            )
        self.check(backend, inputs)
        map_large_allocations()
        positions = self.protocol.positions
        windows = window_tensor(inputs)
        step = progress(self.what, len(windows))
        todo = [w for w in range(len(windows)) if not window_part(folder, w).is_file()]
        for _ in range(len(windows) - len(todo)):
            step()
        for w, states in zip(todo, self.scored_states(backend, windows[todo], positions), strict=True):
            targets = windows[w][positions + 1]
            blocks = logit_blocks(states, self.head_rows, self.chunk_rows, backend.vocab_size)
            save_window_part(folder, w, self.reduce(w, with_targets(blocks, targets), inputs))
            step()
        arrays = joined_window_parts(folder, len(windows))
        meta = {
            **window_logits_meta(backend, inputs),
            "head_chunk_rows": self.head_rows,
            "bytes_per_token": sum(a.nbytes for a in arrays.values()) // len(arrays["nll"]),
        }
        return Observation(name=self.name, meta=self.meta(meta), arrays=arrays)

    def scored_states(
        self, backend: ChunkedHead, windows: torch.Tensor, positions: torch.Tensor
    ) -> Iterator[ScoredStates]:
        """Each window's final hidden states at `positions`, with the head: the backend's own forward."""
        return backend.window_scored_states(windows, positions)

    def check(self, backend: Backend, inputs: Inputs) -> None:
        """Refuse, before any window runs, what this side cannot be observed against."""

    def meta(self, meta: dict[str, Any]) -> dict[str, Any]:
        """The observation's metadata, given what every long-window observation says of itself."""
        return meta


class CompactWindowLogits(_ReducedWindowLogits):
    """Observer of the reference on long windows: per scored token its NLL, top token, `TOP_K_AGREEMENT`
    ranked tokens and compact form (`compact_rows`, with `record`'s options), never its logits."""

    name = REFERENCE_NAME
    what = "window logits, compact (chunked head)"

    def __init__(
        self, protocol: WindowProtocol, record: RecordOptions, chunk_rows: int, head_rows: int
    ) -> None:
        super().__init__(protocol, chunk_rows, head_rows)
        self.record_options = record

    def identity(self) -> dict[str, Any]:
        return {**super().identity(), "record": self.record_options.model_dump(mode="json")}

    def reduce(
        self, window: int, blocks: Iterator[tuple[torch.Tensor, torch.Tensor]], inputs: Inputs
    ) -> dict:
        # Seeded per window, not per run: a resumed observation draws the samples an uninterrupted one draws.
        return compact_reduction(blocks, self.record_options, str(window))

    def meta(self, meta: dict[str, Any]) -> dict[str, Any]:
        # The compact form a recording holds: compared against as a recording is (`kld_per_token`).
        opts = self.record_options
        return {**meta, "kind": "recorded", "top_k": opts.top_k, "tail_samples": opts.tail_samples}

    def record(self, obs: Observation, folder: Path) -> Observation:
        """The observation itself: it holds the compact form already."""
        return Observation(name=obs.name, key=obs.key, meta=dict(obs.meta), arrays=dict(obs.arrays))


class LogitsAtReference(_ReducedWindowLogits):
    """Observer of the candidate on long windows, given the reference's `CompactWindowLogits` (or its
    recording): per scored token its log-probs at the ids the reference kept (`at_top`, `at_tail`), its NLL,
    top token and `TOP_K_AGREEMENT` ranked tokens, and whether some token is most probable on both sides, ties
    included (`same_top`, as `token_ranks.same_top_tied` takes it: the reference's most probable tokens are
    those of its top-k that tie with its first)."""

    name = CANDIDATE_NAME
    what = "window logits at the reference's ids (chunked head)"

    def check(self, backend: Backend, inputs: Inputs) -> None:
        ref = _reference(inputs)
        vocab = ref.meta.get("vocab_size")
        if vocab != backend.vocab_size:
            raise InputError(
                f"the reference's vocabulary ({vocab} tokens) is not the candidate's ({backend.vocab_size})"
            )
        if ref.meta.get("tokens_sha256") != inputs["tokens_sha256"]:
            raise InputError("the reference was observed on other tokens than the candidate's")
        rows = len(inputs["windows"]) * len(self.protocol.positions)
        if len(ref.arrays.get("top_ids", ())) != rows:
            raise InputError(f"the reference's compact form does not hold the {rows} scored tokens")

    def reduce(
        self, window: int, blocks: Iterator[tuple[torch.Tensor, torch.Tensor]], inputs: Inputs
    ) -> dict:
        return at_reference_reduction(
            blocks, _reference(inputs).arrays, window * len(self.protocol.positions)
        )


def compact_reduction(
    blocks: Iterable[tuple[torch.Tensor, torch.Tensor]], opts: RecordOptions, seed_key: str
) -> dict[str, np.ndarray]:
    """The reference's arrays for one sequence's blocks of (logit rows, true next tokens), in row order: per
    row its NLL and top token (`RowScores`), its `TOP_K_AGREEMENT` ranked tokens and its compact form
    (`compact_rows`), the tail's samples seeded by `opts.seed` and `seed_key` (the sequence's own, so that a
    resumed observation draws what an uninterrupted one draws)."""
    seed = hashlib.sha256(f"{opts.seed}:{seed_key}".encode()).digest()[:8]
    generator = torch.Generator().manual_seed(int.from_bytes(seed, "little") >> 1)
    parts: dict[str, list[np.ndarray]] = {k: [] for k in ("nll", "top", "ranked", *COMPACT_ARRAYS)}
    scores = RowScores()
    for block, targets in blocks:
        block = block.cpu()  # the reduction's arrays are numpy's; a GPU's head hands its chunks over here
        _add_nll_and_top(parts, scores, block, targets)
        lp = log_softmax64(block)
        # Ranked apart from the top-k: how torch orders equal BF16 logits depends on k, and top-K
        # agreement must rank as the 512-token protocol does (`token_detail`: top-5 on each side).
        parts["ranked"].append(lp.topk(TOP_K_AGREEMENT, dim=-1).indices.int().numpy())
        for k, v in compact_rows(lp, opts, generator).items():
            parts[k].append(v.numpy())
    return {k: np.concatenate(v) for k, v in parts.items()}


def at_reference_reduction(
    blocks: Iterable[tuple[torch.Tensor, torch.Tensor]], ref: dict[str, np.ndarray], start: int
) -> dict[str, np.ndarray]:
    """The candidate's arrays for one sequence's blocks of (logit rows, true next tokens), its first row row
    `start` of the reference's compact form `ref`: per row its NLL, top token and ranked tokens, its
    log-probs at the ids the reference kept (`at_top`, `at_tail`), `same_top` and the top-K hits."""
    names = ("nll", "top", "ranked", "at_top", "at_tail", "same_top", "top_hits")
    parts: dict[str, list[np.ndarray]] = {k: [] for k in names}
    scores = RowScores()
    for block, targets in blocks:
        block = block.cpu()
        rows = slice(start, start + len(block))
        start += len(block)
        _add_nll_and_top(parts, scores, block, targets)
        lp = log_softmax64(block)
        parts["ranked"].append(lp.topk(TOP_K_AGREEMENT, dim=-1).indices.int().numpy())
        at_top = lp.gather(1, torch.from_numpy(ref["top_ids"][rows]).long())
        at_tail = lp.gather(1, torch.from_numpy(ref["tail_ids"][rows]).long())
        parts["at_top"].append(at_top.float().numpy())
        parts["at_tail"].append(at_tail.float().numpy())
        on_top = (at_top == lp.amax(dim=-1, keepdim=True)).numpy()
        ref_top = ref["top_logp"][rows]
        parts["same_top"].append(np.any(on_top & (ref_top == ref_top[:, :1]), axis=1))
        ref_ids = ref["top_ids"][rows]
        parts["top_hits"].append(top_hits_recorded(ref_ids, ref_top, lp, parts["ranked"][-1]))
    return {k: np.concatenate(v) for k, v in parts.items()}


def long_window_needs(
    protocol: WindowProtocol, record: RecordOptions, chunk_rows: int, head_rows: int
) -> list[Need]:
    """`ppl`'s needs on long windows: the reference's compact form, then the candidate at its ids."""
    return [
        Need(REFERENCE_LABEL, "ref", CompactWindowLogits(protocol, record, chunk_rows, head_rows)),
        Need("ckpt", "ckpt", LogitsAtReference(protocol, chunk_rows, head_rows), consumes=(REFERENCE_LABEL,)),
    ]


def is_at_reference(obs: Observation) -> bool:
    """Whether an observation holds its log-probs at the reference's ids (`LogitsAtReference`, the noise
    floor's `NoisyLogitsAtReference` included)."""
    return obs.name.startswith(CANDIDATE_NAME)


def detail_at_reference(ref: Observation, ckpt: Observation) -> tuple[TokenDetail, np.ndarray, str]:
    """The per-token detail, KL(ref ‖ ckpt) and its estimator's label, from the reference's compact form and
    the candidate's log-probs at its ids (no reverse KLD: the candidate's top ids were never asked of the
    reference)."""
    a, c = ref.arrays, ckpt.arrays
    kld = kld_at_reference(ref, ckpt)
    ref_top_p = np.exp(a["top_logp"][:, 0].astype(np.float64))
    top_ref = a["ranked"] if "ranked" in a else a["top_ids"][:, :TOP_K_AGREEMENT]
    detail = TokenDetail(
        ref_top_p, top_ref, c["ranked"], None, same_top=c["same_top"], top_hits=c.get("top_hits")
    )
    estimator = (
        f"top-{ref.meta['top_k']} exact + {ref.meta['tail_samples']} sampled tail ids "
        "(the reference's compact form, long windows)"
    )
    return detail, kld, estimator


def _reference(inputs: Inputs) -> Observation:
    observed = inputs.get("observed") or {}
    if REFERENCE_LABEL not in observed:
        raise InputError("the candidate's long-window observation needs the reference's, observed first")
    return observed[REFERENCE_LABEL]


def logit_blocks(states: ScoredStates, head_rows: int, chunk_rows: int, vocab: int) -> Iterator[torch.Tensor]:
    """The logits of every scored position, `chunk_rows` rows at a time: the head's output is made
    `head_rows` rows at a time and each block of it normalised on its own (in float64), so neither the
    window's logits nor a chunk's float64 copy ever exist whole."""
    for logits in states.chunks(head_rows):
        if logits.ndim != 2 or logits.shape[1] != vocab:
            raise InputError(
                f"the model's head returned logits of shape {tuple(logits.shape)}, vocabulary {vocab}"
            )
        yield from logits.split(chunk_rows)


def _add_nll_and_top(
    parts: dict[str, list[np.ndarray]], scores: RowScores, block: torch.Tensor, targets: torch.Tensor
) -> None:
    """The true next token's NLL and the top token of a block of logit rows, as the 512-token protocol takes
    them from its stored logits (`WindowLogits`, `RowScores`): the same numbers, bit for bit."""
    nll, top = scores(block, targets)
    parts["nll"].append(nll)
    parts["top"].append(top)


def with_targets(
    blocks: Iterable[torch.Tensor], targets: torch.Tensor
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Each block of logit rows with the true next tokens of its rows (`targets`: every row's, in order)."""
    start = 0
    for block in blocks:
        yield block, targets[start : start + len(block)]
        start += len(block)


def window_part(folder: Path, window: int) -> Path:
    """Where an observation that reduces each window as it completes keeps that window's arrays until the
    last is made."""
    return folder / f"window-{window:04d}.safetensors"


def save_window_part(folder: Path, window: int, arrays: dict[str, np.ndarray]) -> None:
    """One window's arrays, under their final name only once complete (a resumed run trusts what it finds)."""
    from safetensors.numpy import save_file

    with atomic_target(window_part(folder, window)) as tmp:
        save_file({k: np.ascontiguousarray(v) for k, v in arrays.items()}, str(tmp))


def joined_window_parts(folder: Path, windows: int) -> dict[str, np.ndarray]:
    """Every window's saved arrays joined in window order, the parts removed (the observation's own arrays
    hold them now)."""
    parts = [load_window_part(folder, w) for w in range(windows)]
    arrays = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    for w in range(windows):
        window_part(folder, w).unlink()
    return arrays


def load_window_part(folder: Path, window: int) -> dict[str, np.ndarray]:
    """The arrays `save_window_part` saved for a window."""
    from safetensors.numpy import load_file

    return load_file(str(window_part(folder, window)))
