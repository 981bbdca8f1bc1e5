"""Long windows for `ppl`: the `[long_context]` spec section, refusals before any model loads, and metrics
by position in the window.

How a long window is observed (the head applied a chunk of positions at a time, each chunk reduced at once to
what the comparison needs) is `evalsuite.observers.compact_window_logits`.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any

import numpy as np
from pydantic import Field

from evalsuite.contract.spec import StrictModel
from evalsuite.errors import InputError
from evalsuite.observers.window_logits import WindowProtocol
from evalsuite.protocol.task import Inputs
from evalsuite.stats import metrics
from evalsuite.tasks.ppl_subsets import subset_metrics

if TYPE_CHECKING:
    from evalsuite.protocol.side import Side


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


def check_long_windows(
    protocol: WindowProtocol, options: LongContext, inputs: Inputs, sides: list[Side]
) -> None:
    """Refuse, before any model loads, a window longer than a side's context (`max_position_embeddings`:
    positions beyond it are not what the model was trained on) and, when the spec asks for every window, a
    text too short for them (InputError naming the lengths)."""
    for side in sides:
        if side.checkpoint is None:
            continue
        context = context_length(side.checkpoint.config)
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


def context_length(config: dict[str, Any]) -> int | None:
    """A model's context from its config.json (`max_position_embeddings`, its text model's first); None
    where it does not say."""
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
    windows: np.ndarray | None = None,
) -> dict[str, float | int]:
    """Per position bucket (`metrics.position_buckets`): its token count, mean KLD with its standard error,
    same-top-token rate, mean Δp and ln PPL ratio; with the tokens' `windows` (cluster labels), the
    window-clustered error of each mean and share (`_stderr_window`: null with fewer than two windows)."""
    values: dict[str, float | int] = {}
    for name, mask in metrics.position_buckets(positions, edges):
        values.update(subset_metrics(name, mask, kld, same_top, nll_ref, nll_ckpt, windows))
    return values
