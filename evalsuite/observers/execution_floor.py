"""The reference against itself in another execution: its `ppl` windows forwarded several at a time
(`--execution-floor`), each compared with its own window forwarded alone, as the candidate's are.

The same weights give other logits in another batch: the matrix products take other shapes and add in
another order (and on a GPU, another kernel setting rounds otherwise), and the same checkpoint scores
differently with the batch size and the engine (lm-eval#1625, vLLM#32480). A candidate's difference from the
reference that is no larger than the reference's own difference from itself, run another way, is no finding.
So this observation is the reference's windows forwarded `windows_per_forward` at a time (equal lengths: no
padding), on a CUDA device with cuBLAS's reduced-precision BF16 reduction the other way round too, each
window compared with the reference's file of it in the arithmetic the candidate's comparison uses
(`PairedWindowLogits`): per scored token both KL divergences and the top tokens.

A backend that forwards no batch of windows (a streamed side runs each window through a layer at a time; a
recording runs nothing) gives an observation that says so, and `ppl` reports the figures as not measured
with that reason rather than a difference of zero.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from evalsuite.contract.observation import Observation
from evalsuite.observers.paired_window_logits import PairedWindowLogits, paired_detail
from evalsuite.observers.window_logits import RecordOptions, WindowProtocol, window_tensor
from evalsuite.protocol.task import Inputs, Progress
from evalsuite.stats import claims, metrics

if TYPE_CHECKING:
    from evalsuite.backends import Backend

EXECUTION_FLOOR_LABEL = "execution-floor"
# Windows forwarded together: what a serving engine's batch of requests of one length does.
WINDOWS_PER_FORWARD = 4


class ExecutionFloorLogits(PairedWindowLogits):
    """Observer of the reference, given its own `WindowLogits` observation: see the module's docstring."""

    name = "window-logits-execution-floor"
    # Never made in a streamed side's shared pass: there each window runs alone, the execution compared with.
    visitor = None
    # The comparison is compact (per scored token): it is its own recording.
    records_itself = True

    def __init__(
        self,
        protocol: WindowProtocol,
        record: RecordOptions | None = None,
        chunk_rows: int = 16,
        windows_per_forward: int = WINDOWS_PER_FORWARD,
    ) -> None:
        super().__init__(protocol, record, chunk_rows)
        self.windows_per_forward = windows_per_forward

    def identity(self) -> dict[str, Any]:
        return {**super().identity(), "windows_per_forward": self.windows_per_forward}

    def observe(self, backend: Backend, inputs: Inputs, folder: Path, progress: Progress) -> Observation:
        batched = getattr(backend, "window_logits_batched", None)
        if not callable(batched):
            why = (
                f"the reference runs on {type(backend).__name__}, which forwards one window at a time: there "
                "is no batched execution of it to compare with"
            )
            return Observation(name=self.name, meta={"unavailable": why})
        windows = window_tensor(inputs)
        step = progress("execution floor", len(windows))
        positions, k = self.protocol.positions, self.windows_per_forward
        obs = self.observed(backend, inputs, folder, lambda todo: batched(windows[todo], positions, k), step)
        obs.meta.update(windows_per_forward=k, kernel_setting=backend.batched_kernel_setting)
        return obs

    def record(self, obs: Observation, folder: Path) -> Observation:
        """Per-token comparisons are compact already: the observation is its own recording."""
        return Observation(name=obs.name, key=obs.key, meta=obs.meta, arrays=obs.arrays)


def is_unavailable(obs: Observation) -> str | None:
    """Why an execution-floor observation could not be made, or None where it was."""
    return obs.meta.get("unavailable")


def execution_floor_metrics(
    ref: Observation, floor: Observation, kld: np.ndarray, windows: np.ndarray
) -> tuple[dict[str, Any], dict[str, str]]:
    """The reference's difference from itself in the other execution, as `ppl` reports it (`execution_floor_`
    figures: its mean KLD and same-top rate, window-clustered errors), and where the candidate's per-token
    KLD `kld` stands against it, paired by token: `within` when the upper 95% bound of mean(kld − floor) is
    at most 0, `above` when its lower bound exceeds 0, else `undetermined` (`claims.against_floor`, margin
    0). Where the floor could not be observed, every figure is None with the reason (the second mapping)."""
    why = is_unavailable(floor)
    if why is not None:
        names = ("execution_floor_kld_mean", "execution_floor_same_top_p", "execution_floor")
        return dict.fromkeys(names), dict.fromkeys(names, why)
    detail = paired_detail(ref, floor)
    floor_kld = np.asarray(detail.kld, dtype=np.float64)
    same = np.asarray(detail.same_top, dtype=np.float64)
    against = claims.against_floor(kld, [floor_kld], windows, 0.0)
    return {
        "execution_floor_kld_mean": float(floor_kld.mean()),
        "execution_floor_kld_mean_stderr_window": metrics.clustered_stderr(floor_kld, windows),
        "execution_floor_same_top_p": float(same.mean()),
        "execution_floor_same_top_p_stderr_window": metrics.clustered_stderr(same, windows),
        "execution_floor_windows_per_forward": int(floor.meta["windows_per_forward"]),
        "execution_floor_kernel_setting": str(floor.meta["kernel_setting"]),
        "execution_floor_excess": against.beyond.value,
        "execution_floor_excess_upper95": against.bound("upper95"),
        "execution_floor_excess_lower95": against.bound("lower95"),
        "execution_floor": against.outcome,
    }, {}
