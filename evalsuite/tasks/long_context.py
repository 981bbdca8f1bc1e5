"""Long windows for `ppl`: logits made and consumed a chunk of positions at a time, and metrics by position.

The 512-token protocol asks the model's forward for the logits of every scored position at once: for a
window of 32 k tokens over a 248 k-token vocabulary that tensor alone is 16 GB in bf16. `ChunkedWindowLogits`
asks the backend for the final hidden states at the scored positions instead (`ChunkedHead`) and applies the
model's own head to `head_chunk_rows` of them at a time, each chunk's logits appended to the window's file
and dropped. What it stores is what `WindowLogits` stores (the same per-window files, the same per-token
NLL and top token), so the comparison, the recording and the replay are those of the 512-token protocol,
which already read the files a few rows at a time: memory beyond the model grows with the window only
through the model's own activations, never with window × vocabulary.

Per scored token an observation holds its logits row (vocabulary × the model's dtype, 2 bytes per entry for
bf16) in its files and 16 bytes of arrays (NLL, top token); a recording of it keeps the compact form
(`RecordOptions`: top-k and tail samples), `observation_bytes_per_token` and `recording_bytes_per_token`.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from pydantic import Field

from evalsuite import metrics
from evalsuite.errors import InputError
from evalsuite.observation import Observation
from evalsuite.spec import StrictModel
from evalsuite.task import Inputs, Progress
from evalsuite.tasks.logits_file import STORED_DTYPES, window_file, write_window_chunks
from evalsuite.tasks.window_logits import (
    RecordOptions,
    WindowLogits,
    WindowProtocol,
    window_logits_meta,
    window_tensor,
)

if TYPE_CHECKING:
    from evalsuite.backends import Backend
    from evalsuite.side import Side

OBSERVER_NAME = "window-logits-chunked"


class LongContext(StrictModel):
    """The `[long_context]` section of a `ppl` spec. Its defaults leave the 512-token protocol as it was."""

    # Positions per application of the head; 0: the forward's own head on every scored position at once.
    head_chunk_rows: int = 0
    # Bucket edges: metrics for positions [e0, e1), [e1, e2), …, [e_last, ∞); none: no bucket metrics.
    position_buckets: list[int] = Field(default_factory=list)
    # Refuse a text too short for every window asked, rather than score those that fit with a note.
    every_window: bool = False

    def model_post_init(self, _: Any) -> None:
        if self.head_chunk_rows < 0:
            raise ValueError("head_chunk_rows must be 0 (the whole head at once) or a number of positions")
        edges = self.position_buckets
        if edges and (edges[0] < 0 or any(b <= a for a, b in itertools.pairwise(edges))):
            raise ValueError("position_buckets must be increasing positions from 0 up, e.g. [0, 1024, 4096]")


def observation_bytes_per_token(vocab_size: int, dtype: torch.dtype) -> int:
    """Bytes an observation keeps per scored token: the logits row in its file, NLL (float64) and top token
    (int64) in its arrays."""
    itemsize = np.dtype(STORED_DTYPES[dtype]).itemsize
    return vocab_size * itemsize + 16


def recording_bytes_per_token(options: RecordOptions) -> int:
    """Bytes a recording keeps per scored token: top-k ids (int32) and log-probs (float32), the tail mass
    (float64), the tail samples' ids and log-probs, NLL and top token."""
    return 8 * options.top_k + 8 + 8 * options.tail_samples + 16


class ChunkedWindowLogits(WindowLogits):
    """Observer: `WindowLogits`'s observation, the head applied `head_rows` positions at a time."""

    name = OBSERVER_NAME

    def __init__(
        self,
        protocol: WindowProtocol,
        record: RecordOptions | None = None,
        chunk_rows: int = 16,
        head_rows: int = 256,
    ) -> None:
        super().__init__(protocol, record, chunk_rows)
        self.head_rows = head_rows

    def identity(self) -> dict[str, Any]:
        return {"protocol": self.protocol.model_dump(mode="json"), "head_chunk_rows": self.head_rows}

    def observe(self, backend: Backend, inputs: Inputs, folder: Path, progress: Progress) -> Observation:
        from evalsuite.backends import ChunkedHead

        if not isinstance(backend, ChunkedHead):
            raise InputError(
                f"backend {backend.describe().get('backend', type(backend).__name__)} cannot apply its head "
                "per chunk of positions; set [long_context] head_chunk_rows = 0 to score whole windows"
            )
        positions = self.protocol.positions
        windows = window_tensor(inputs)
        step = progress("window logits (chunked head)", len(windows))
        todo = [w for w in range(len(windows)) if not window_file(folder, w).is_file()]
        for _ in range(len(windows) - len(todo)):
            step()
        dtypes: set[torch.dtype] = set()
        for w, states in zip(todo, backend.window_scored_states(windows[todo], positions), strict=True):
            chunks = _checked(states.chunks(self.head_rows), backend.vocab_size, dtypes)
            write_window_chunks(folder, w, len(positions), chunks)
            step()
        files = {f"window-{w:04d}": window_file(folder, w) for w in range(len(windows))}
        nll, top = self._scores(list(files.values()), windows, positions)
        meta = {**window_logits_meta(backend, inputs), "head_chunk_rows": self.head_rows}
        if dtypes:
            meta["bytes_per_token"] = observation_bytes_per_token(backend.vocab_size, dtypes.pop())
        return Observation(name=self.name, meta=meta, arrays={"nll": nll, "top": top}, files=files)

    def record(self, obs: Observation, folder: Path) -> Observation:
        """`WindowLogits.record`, with the bytes it keeps per scored token in its metadata."""
        compact = super().record(obs, folder)
        compact.meta["bytes_per_token"] = recording_bytes_per_token(self.record_options)
        return compact


def _checked(chunks: Iterator[torch.Tensor], vocab: int, dtypes: set[torch.dtype]) -> Iterator[torch.Tensor]:
    """The chunks, each refused unless (rows, vocab); their dtypes noted in `dtypes`."""
    for logits in chunks:
        if logits.ndim != 2 or logits.shape[1] != vocab:
            raise InputError(
                f"the model's head returned logits of shape {tuple(logits.shape)}, vocabulary {vocab}"
            )
        dtypes.add(logits.dtype)
        yield logits


def check_long_windows(
    protocol: WindowProtocol, options: LongContext, inputs: Inputs, sides: list[Side]
) -> None:
    """Refuse, before any model loads, a window longer than a side's context (`max_position_embeddings`:
    positions beyond it are not what the model was trained on) and, when the spec asks for every window, a
    text too short for them (InputError naming the lengths)."""
    for side in sides:
        if side.checkpoint is None:
            continue
        context = _context_length(side.checkpoint.config)
        if context is not None and protocol.window > context:
            raise InputError(
                f"the protocol's {protocol.window}-token window is longer than the model's context "
                f"({context} tokens, max_position_embeddings in config.json)",
                side.checkpoint.path,
            )
    asked = protocol.starts.count
    fitted = len(inputs["starts"])
    if options.every_window and fitted < asked:
        needed = protocol.starts.first + (asked - 1) * protocol.starts.step + protocol.window
        raise InputError(
            f"the {inputs['corpus']} text has {inputs['n_tokens_text']} tokens, too short for the protocol's "
            f"{asked} window(s) of {protocol.window} tokens ({needed} tokens needed, {fitted} fit); "
            "give a longer text (--text-file) or ask fewer or shorter windows"
        )


def _context_length(config: dict[str, Any]) -> int | None:
    for doc in (config.get("text_config") or {}, config):
        value = doc.get("max_position_embeddings") if isinstance(doc, dict) else None
        if isinstance(value, int) and value > 0:
            return value
    return None


def scored_positions(protocol: WindowProtocol, n_windows: int) -> np.ndarray:
    """The position in its window of every scored token, in observation order (window after window)."""
    return np.tile(protocol.positions.numpy(), n_windows)


def position_bucket_metrics(
    edges: list[int],
    positions: np.ndarray,
    kld: np.ndarray,
    same_top: np.ndarray,
    nll_ref: np.ndarray,
    nll_ckpt: np.ndarray,
) -> dict[str, float | int]:
    """Per position bucket (`metrics.position_buckets`): its token count, mean KLD with its standard error,
    same-top-token rate, mean Δp and ln PPL ratio. The errors are per token: tokens of one window are
    correlated, so they are lower bounds."""
    values: dict[str, float | int] = {}
    for name, mask in metrics.position_buckets(positions, edges):
        kld_mean = metrics.mean_with_stderr(kld[mask])
        same = metrics.rate_with_stderr(same_top[mask])
        dp = metrics.delta_p(-nll_ref[mask], -nll_ckpt[mask])
        ln_ratio = metrics.paired_log_ratio(nll_ref[mask], nll_ckpt[mask])
        values.update(
            {
                f"{name}_n_tokens": int(mask.sum()),
                f"{name}_kld_mean": kld_mean.value,
                f"{name}_kld_mean_stderr": kld_mean.stderr,
                f"{name}_same_top_p": same.value,
                f"{name}_delta_p_mean": dp.mean.value,
                f"{name}_rms_delta_p": dp.rms.value,
                f"{name}_ln_ppl_ratio": ln_ratio.value,
            }
        )
    return values
