"""The candidate's `ppl` observation beside a live reference: each window compared as the model makes it.

The 512-token protocol keeps the reference's scored logits on disk (bf16, one file per window: a resumed run,
`compare`'s other candidates and `evalsuite record` read them). The candidate's, written and read back once
by the KLD detail, served nothing else: here the candidate's observation consumes the reference's
(`Need.consumes`) and compares each window it forwards with the reference's file of that window at once, in
the float32 detail's arithmetic (`kld_detail.pair_blocks`: the same bits as from two files). It keeps per
scored token what the comparison reads: both KL divergences, the reference's top-1 probability, both sides'
ranked top tokens, the top-K hits, and the NLL and top token every window observation keeps. Each window's
arrays are saved as it completes: an interrupted observation resumes at the next window.

The comparison runs before the next forward where no core is free for it, beside it where one is (the
forward runs on an accelerator, or this process may use more cores than torch's threads), as the
reference's writes do (`logits_file.core_left_for_writing`).

What it gives up against storing the candidate's logits: the reuse of its observation against another
reference (its key holds the reference's). `[compare] precision = "float64"` observes the candidate as before
(`WindowLogits`), and against a recorded reference, which has no files, the candidate's logits are stored as
before and compared as against any recording.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from evalsuite.backends.c_heap import release_freed_memory
from evalsuite.contract.observation import Observation
from evalsuite.errors import InputError
from evalsuite.observers.compact_window_logits import (
    REFERENCE_LABEL,
    joined_window_parts,
    save_window_part,
    window_part,
)
from evalsuite.observers.kld_detail import (
    TokenDetail,
    detail_of_pairs,
    detail_threads,
    pair_blocks,
    pairs_in_threads,
)
from evalsuite.observers.logits_file import Header, core_left_for_writing, read_header, read_rows
from evalsuite.observers.window_logits import (
    WindowLogits,
    check_logits_shape,
    check_same_shape,
    numpy_rows,
    window_logits_meta,
    window_paths,
    window_tensor,
)
from evalsuite.protocol.task import Inputs
from evalsuite.stats.logit_rows import target_nll

if TYPE_CHECKING:
    from evalsuite.backends import Backend

CANDIDATE_NAME = "window-logits-paired"
# The fewest rows a thread takes when one window's rows are split between threads.
ROWS_PER_THREAD = 16


class PairedWindowLogits(WindowLogits):
    """Observer of the candidate in `ppl` (512-token protocol, float32 detail), given the reference's
    `WindowLogits` observation: see the module's docstring."""

    name = CANDIDATE_NAME

    def observed(
        self,
        backend: Backend,
        inputs: Inputs,
        folder: Path,
        logits_of: Callable[[list[int]], Iterable[torch.Tensor]],
        step: Callable[[], None],
    ) -> Observation:
        ref = (inputs.get("observed") or {}).get(REFERENCE_LABEL)
        if ref is None or ref.meta.get("kind") == "recorded" or not window_paths(ref):
            return super().observed(backend, inputs, folder, logits_of, step)
        positions = self.protocol.positions
        windows = window_tensor(inputs)
        ref_paths = window_paths(ref)
        headers = [read_header(path) for path in ref_paths]
        expected = (len(positions), backend.vocab_size)
        if len(ref_paths) != len(windows) or any(tuple(h[0]) != expected for h in headers):
            raise InputError(
                f"the reference's observation holds {len(ref_paths)} windows of logits shaped "
                f"{sorted({tuple(h[0]) for h in headers})}; the candidate makes {len(windows)} of {expected}",
                ref_paths[0].parent if ref_paths else None,
            )
        todo = [w for w in range(len(windows)) if not window_part(folder, w).is_file()]
        for _ in range(len(windows) - len(todo)):
            step()
        pending: Future | None = None
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="window-pairs") as beside:
            for w, logits in zip(todo, logits_of(todo), strict=True):
                check_logits_shape(logits, expected)
                job = functools.partial(
                    self._compare_window, folder, w, ref_paths[w], headers[w], logits.cpu(), windows[w]
                )
                if pending is not None:
                    pending.result()
                    pending = None
                if core_left_for_writing(logits):
                    pending = beside.submit(job)
                else:
                    job()
                step()
            if pending is not None:
                pending.result()
        arrays = joined_window_parts(folder, len(windows))
        meta = {**window_logits_meta(backend, inputs), "kind": "paired", "paired_with": ref.key}
        return Observation(name=self.name, meta=meta, arrays=arrays)

    def _compare_window(
        self, folder: Path, w: int, ref_path: Path, header: Header, rows: torch.Tensor, window: torch.Tensor
    ) -> None:
        """One window's comparison with the reference's file of it, and its NLL and top tokens (from the
        comparison's own pass: the bits `WindowLogits` gives them), saved."""
        (ref_rows,) = read_rows([ref_path], len(rows), [header])
        arrays = pair_rows(ref_rows, rows)
        targets = window[self.protocol.positions + 1].numpy()
        nll = target_nll(arrays.pop("ckpt_log_norm"), numpy_rows(rows), targets)
        top = arrays["top_ckpt"][:, 0].astype(np.int64)
        save_window_part(folder, w, {**arrays, "nll": nll, "top": top})
        # The comparison's vocabulary-wide blocks, freed in the heaps of the threads that made them, handed
        # back as `WindowLogits` hands back a window's (`c_heap.release_freed_memory`).
        del ref_rows, rows
        release_freed_memory()


def pair_rows(ref_rows: torch.Tensor, ckpt_rows: torch.Tensor) -> dict[str, np.ndarray]:
    """The float32 detail of two sides' rows of logits in memory: `kld_detail.PAIR_ARRAYS` per row, the rows
    split between `kld_detail.detail_threads` threads (per row the same bits however they are split)."""
    check_same_shape(ref_rows, ckpt_rows)
    n = len(ref_rows)
    bounds = np.linspace(0, n, detail_threads(n // ROWS_PER_THREAD) + 1).round().astype(int)
    parts = [[(ref_rows[a:b], ckpt_rows[a:b])] for a, b in itertools.pairwise(bounds) if b > a]
    return pairs_in_threads(pair_blocks, parts)


def is_paired(obs: Observation) -> bool:
    """Whether a candidate's observation holds its comparison with the reference (`PairedWindowLogits`)
    rather than its logits."""
    return obs.meta.get("kind") == "paired"


def paired_detail(ref: Observation, ckpt: Observation) -> TokenDetail:
    """The per-token detail a paired candidate observation holds, checked to be against `ref`."""
    if ckpt.meta.get("paired_with") != ref.key:
        raise InputError(
            f"the candidate's observation was compared with reference {ckpt.meta.get('paired_with')}, "
            f"not with this run's ({ref.key})"
        )
    return detail_of_pairs(ckpt.arrays)
