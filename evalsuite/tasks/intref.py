"""The integer W4A8 reference execution of the candidate: its PPL, and how far stock Transformers is from it.

The `ppl` protocol (same windows, same scored positions, same tokens) observed three times: the reference as
usual, the candidate through backend `intref` (integer arithmetic reading the packed weights) and the same
candidate through backend `hf` (as Transformers runs it). The reference's and the `hf` candidate's window
logits are the very observations `ppl` makes, so a run of both tasks observes them once. The comparison
reports the integer model's PPL against the reference's, and the KL divergence and same-top-token rate
between the two executions of the one candidate, KL(P_int ‖ P_hf): the integer execution is the model the
card describes, `hf` the approximation. Its floor is measured in the same direction, KL(P_noisy ‖ P_hf), `hf`
against its own reruns with rounding-sized noise, every draw; the same-top-token events count ties (some
token most probable on both sides), as `ppl`'s do.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from evalsuite.backends.intref_plan import ActivationConvention, integer_modules_or_reason
from evalsuite.backends.options import ADD_ACTIVATION_QUANTIZATION
from evalsuite.contract.observation import Observation
from evalsuite.contract.spec import TaskSpec
from evalsuite.errors import InputError
from evalsuite.observers.kld_detail import Precision, token_detail
from evalsuite.observers.noise_floor import NoiseFloorOptions, NoisyWindowLogits
from evalsuite.observers.window_logits import (
    FULL_VOCABULARY,
    RecordOptions,
    WindowLogits,
    WindowProtocol,
    kld_per_token,
    ppl_summary,
    prepare_windows,
    same_inputs,
)
from evalsuite.plotting import plots
from evalsuite.protocol.side import Side
from evalsuite.protocol.task import (
    Difference,
    Inputs,
    Need,
    RunContext,
    TaskResult,
    TaskSkipped,
    clustered_difference,
    task,
)
from evalsuite.stats import claims, metrics
from evalsuite.tasks.ppl import CompareOptions


class IntrefSpec(TaskSpec):
    """The `ppl` protocol and the integer path's activation convention (handed to backend `intref`)."""

    activations: ActivationConvention = ActivationConvention()
    protocol: WindowProtocol = WindowProtocol()
    record: RecordOptions = RecordOptions()
    compare: CompareOptions = CompareOptions()
    # The `hf` execution again with rounding-sized noise on its decoder layers: how far two roundings of the
    # one candidate part on their own, the floor the integer execution is judged above.
    hf_floor: NoiseFloorOptions = NoiseFloorOptions(enabled=True)


@task("intref")
class IntegerReference:
    """PPL of the integer W4A8 execution, and its KLD / same-top-token agreement with the `hf` execution."""

    spec_model: ClassVar[type[TaskSpec]] = IntrefSpec
    metric_names: ClassVar[tuple[str, ...]] = (
        "n_windows",
        "n_scored_tokens",
        "int_convention",
        "hf_convention",
        "ppl_ref",
        "ppl_int",
        "ppl_int_ratio",
        "ln_ppl_int_ratio",
        "ppl_hf",
        "kld_int_mean",
        "same_top_int",
        "kld_int_vs_hf",
        "kld_int_vs_hf_p99",
        "kld_int_vs_hf_max",
        "same_top_int_vs_hf",
        "kld_hf_floor",
        "same_top_hf_floor",
        "kld_int_vs_hf_above_floor",
        "kld_int_vs_hf_beyond_allowed",
        "int_vs_hf_floor",
        "same_top_int_vs_hf_below_floor",
        "int_layers",
        "int_experts",
    )

    metric_descriptions: ClassVar[dict[str, str]] = {
        "int_convention": "the integer execution's arithmetic: weight schemes × activation quantization, and "
        "whether the activations' quantization is the scheme's or added by intref (weight-only schemes)",
        "hf_convention": "how Transformers executed the same candidate",
        "ppl_int": "perplexity of the candidate executed in integers (INT8 activations × INT4/INT8 weights)",
        "ppl_int_ratio": "ppl_int / ppl_ref: the W4A8 model's own PPL increase over the reference",
        "ppl_hf": "perplexity of the same candidate as Transformers runs it (dequantized weights; "
        "activations as hf_convention says)",
        "kld_int_mean": "mean KL(ref ‖ int): the integer model against the reference",
        "kld_int_vs_hf": "mean KL(int ‖ hf): how far Transformers' execution is from the integer model",
        "same_top_int_vs_hf": "share of positions where the integer and Transformers executions agree on top "
        "(some token most probable on both: ties counted as agreement)",
        "kld_hf_floor": "mean KL(hf with rounding-sized noise on each decoder layer ‖ hf), in the direction "
        "of kld_int_vs_hf, averaged over the noise draws: how far two roundings of the same candidate part "
        "on their own",
        "same_top_hf_floor": "share of positions where the hf execution and its noisy reruns agree on top "
        "(ties counted as agreement), averaged over the noise draws",
        "kld_int_vs_hf_above_floor": "kld_int_vs_hf − kld_hf_floor, paired by token: the integer execution's "
        "distance from Transformers' beyond what rounding alone puts between two executions",
        "kld_int_vs_hf_beyond_allowed": "mean per-token KL(int ‖ hf) − (1 + margin) × the floor's, paired by "
        "token: the statistic int_vs_hf_floor is tested on",
        "int_vs_hf_floor": "within: the upper 95% bound of kld_int_vs_hf_beyond_allowed (window-clustered, t "
        "with windows − 1 degrees of freedom) is at most 0, kld_int_vs_hf shown to be at most (1 + margin) × "
        "kld_hf_floor; above: its lower bound exceeds 0; undetermined: neither is shown",
        "same_top_int_vs_hf_below_floor": "same_top_hf_floor − same_top_int_vs_hf, paired by token: "
        "top-token disagreement beyond rounding's own",
        "int_layers": "integer Linear layers that ran (of int_layers_total)",
        "int_experts": "routed experts that ran in integers (of int_experts_total)",
        "activation_divisor": "per-token activation scale = max|x| / this divisor (the spec's convention)",
    }

    def __init__(self, spec: IntrefSpec, context: RunContext) -> None:
        self.spec = spec
        self.context = context
        # The `hf` execution's conventions, decided from the candidate's scheme in `prepare`.
        self._hf_conventions: tuple[tuple[str, Any], ...] = ()

    def prepare(self, ref: Side, ckpt: Side) -> Inputs:
        """The `ppl` inputs; skipped, with the reason, for a candidate the integer path cannot execute.

        `evalsuite record` prepares one side as both (it records the reference, which needs no integer path).
        """
        if ckpt is not ref:
            modules = integer_modules_or_reason(ckpt.checkpoint)
            if isinstance(modules, str):
                raise TaskSkipped(modules)
            # A weight-only scheme runs in integers with activations intref quantizes itself: Transformers'
            # execution then quantizes them too, or the two would be two models, not two executions of one.
            self._hf_conventions = (
                ((ADD_ACTIVATION_QUANTIZATION, True),) if any(m.weight_only for m in modules.values()) else ()
            )
        return prepare_windows(self.spec.protocol, self.context.corpus, ref, ckpt, self.context.shared)

    def needs(self) -> list[Need]:
        observer = WindowLogits(self.spec.protocol, self.spec.record, self.spec.compare.kld_chunk_rows)
        conventions = tuple(sorted(self.spec.activations.model_dump(mode="json").items()))
        needs = [
            Need("ref", "ref", observer),
            Need("int", "ckpt", observer, backend="intref", conventions=conventions),
            Need("hf", "ckpt", observer, backend="hf", conventions=self._hf_conventions),
        ]
        floor = self.spec.hf_floor
        if floor.enabled:
            chunk = self.spec.compare.kld_chunk_rows
            for i in range(floor.draws):
                noisy = NoisyWindowLogits(self.spec.protocol, self.spec.record, chunk, noise=floor.draw(i))
                label = floor.label(i, "hf_floor")
                needs.append(Need(label, "ckpt", noisy, backend="hf", conventions=self._hf_conventions))
        return needs

    def paired_differences(self, values: dict[str, Any]) -> list[Difference]:
        """The integer execution's PPL against the reference's, and its distance from Transformers' execution
        beyond rounding's (KLD and top-token agreement), each paired by token: what reports name where
        significant."""
        ppl = f"{Difference.figure(values.get('ppl_ref'))} → {Difference.figure(values.get('ppl_int'))}"
        found = [
            clustered_difference(
                "PPL of the integer execution",
                f"{ppl} (ratio {Difference.figure(values.get('ppl_int_ratio'))})",
                "ln_ppl_int_ratio",
                values,
                True,
                "ppl_int_ratio",
            ),
            clustered_difference(
                "KLD between the integer and Transformers' executions beyond the floor",
                f"{Difference.figure(values.get('kld_int_vs_hf_above_floor'))} nats",
                "kld_int_vs_hf_above_floor",
                values,
                True,
                "kld_int_vs_hf",
            ),
            clustered_difference(
                "top-token agreement of the integer and Transformers' executions below the floor's",
                f"{Difference.figure(values.get('same_top_int_vs_hf_below_floor'))}",
                "same_top_int_vs_hf_below_floor",
                values,
                True,
                "same_top_int_vs_hf",
            ),
        ]
        return [d for d in found if d is not None]

    def compare(self, observed: Mapping[str, Observation], artifacts: Path) -> TaskResult:
        ref, ints, hf = observed["ref"], observed["int"], observed["hf"]
        same_inputs({"ref": ref, "int": ints, "hf": hf})
        execution = ints.meta.get("execution", {})
        if execution.get("backend") != "intref":
            raise InputError(f"the integer observation ran on backend {execution.get('backend')!r}")
        n_windows = ref.meta["n_windows"]
        nll_ref, nll_int, nll_hf = ref.arrays["nll"], ints.arrays["nll"], hf.arrays["nll"]
        windows = metrics.window_labels(n_windows, len(nll_ref) // n_windows)
        chunk, precision = self.spec.compare.kld_chunk_rows, self.spec.compare.precision
        ln_ratio = metrics.paired_log_ratio(nll_ref, nll_int)
        kld_int, same_int, estimator = kld_and_same_top(ref, ints, chunk, precision)
        kld_int_mean = metrics.mean_with_stderr(kld_int)
        same_top_int = metrics.rate_with_stderr(same_int)
        # KL(P_int ‖ P_hf): the integer execution is the distribution the card describes.
        kld_ih, same_ih, _ = kld_and_same_top(ints, hf, chunk, precision)
        kld_ih_mean = metrics.mean_with_stderr(kld_ih)
        same_top_ih = metrics.rate_with_stderr(same_ih)
        values: dict[str, Any] = {
            "corpus": ref.meta["corpus"],
            "n_windows": n_windows,
            "n_scored_tokens": len(nll_ref),
            "tokens_sha256": ref.meta["tokens_sha256"],
            "int_convention": execution.get("convention", "W4/W8 channel × A8 per token"),
            "hf_convention": str(hf.meta.get("execution", {}).get("execution", "Transformers")),
            "activation_divisor": execution["activations"]["divisor"],
            "activation_rounding": execution["activations"]["rounding"],
            **ppl_summary("ref", nll_ref, n_windows),
            **ppl_summary("int", nll_int, n_windows),
            "ppl_int_ratio": float(np.exp(ln_ratio.value)),
            "ln_ppl_int_ratio": ln_ratio.value,
            "ln_ppl_int_ratio_stderr": ln_ratio.stderr,
            "ln_ppl_int_ratio_stderr_window": metrics.clustered_stderr(nll_int - nll_ref, windows),
            **ppl_summary("hf", nll_hf, n_windows),
            "kld_int_mean": kld_int_mean.value,
            "kld_int_mean_stderr": kld_int_mean.stderr,
            "kld_int_mean_stderr_window": metrics.clustered_stderr(kld_int, windows),
            "kld_int_estimator": estimator,
            "same_top_int": same_top_int.value,
            "same_top_int_stderr": same_top_int.stderr,
            "same_top_int_stderr_window": metrics.clustered_stderr(same_int, windows),
            "kld_int_vs_hf": kld_ih_mean.value,
            "kld_int_vs_hf_stderr": kld_ih_mean.stderr,
            "kld_int_vs_hf_stderr_window": metrics.clustered_stderr(kld_ih, windows),
            "kld_int_vs_hf_p99": metrics.quantiles(kld_ih, (0.99,))[0],
            "kld_int_vs_hf_max": float(kld_ih.max()),
            "same_top_int_vs_hf": same_top_ih.value,
            "same_top_int_vs_hf_stderr": same_top_ih.stderr,
            "same_top_int_vs_hf_stderr_window": metrics.clustered_stderr(same_ih, windows),
            "int_layers": execution["int_layers"],
            "int_layers_total": execution["int_layers_total"],
            "int_experts": execution["int_experts"],
            "int_experts_total": execution["int_experts_total"],
        }
        if "hf_floor" in observed:
            floor = self.spec.hf_floor
            draws = [observed[floor.label(i, "hf_floor")] for i in range(floor.draws)]
            values.update(_floor_metrics(hf, draws, kld_ih, same_ih, windows, chunk, precision, floor.margin))
        checks, _ = self.spec.threshold_checks(values)
        made = {}
        if self.context.plots:
            plots.kld_histogram(
                kld_ih, artifacts / "intref_kld_int_vs_hf.png", "full-vocabulary", title="KL(int ‖ hf)"
            )
            made["kld_int_vs_hf_histogram"] = f"{artifacts.name}/intref_kld_int_vs_hf.png"
        return TaskResult.from_checks(values, checks, artifacts=made)


def kld_and_same_top(
    p: Observation, q: Observation, chunk_rows: int, precision: Precision
) -> tuple[np.ndarray, np.ndarray, str]:
    """Per scored token, KL(P_p ‖ P_q), whether the sides' most probable tokens agree, ties included
    (`token_ranks.same_top_tied`, as `ppl` counts them), and the KLD's estimator; `p` may be a recording."""
    detail = token_detail(p, q, chunk_rows, precision)
    assert detail.same_top is not None
    if detail.kld is not None:
        return detail.kld, detail.same_top, FULL_VOCABULARY
    kld, estimator = kld_per_token(p, q, chunk_rows)
    return kld, detail.same_top, estimator


def _floor_metrics(
    hf: Observation,
    floors: list[Observation],
    kld_ih: np.ndarray,
    same_ih: np.ndarray,
    windows: np.ndarray,
    chunk_rows: int,
    precision: Precision,
    margin: float,
) -> dict[str, Any]:
    """The `hf` execution's noisy reruns against it, KL(P_noisy ‖ P_hf) in the direction of KL(P_int ‖ P_hf),
    every draw (per-token KLDs and same-top events averaged over the draws), and the integer execution's
    distance from `hf` beyond that floor: per-token differences paired by token, with window-clustered
    standard errors, and the equivalence outcome, kld_int_vs_hf at most (1 + `margin`) × the floor
    (`claims.FloorComparison`)."""
    for i, floor in enumerate(floors):
        same_inputs({"hf": hf, f"hf_floor_{i}": floor})
    pairs = [kld_and_same_top(floor, hf, chunk_rows, precision) for floor in floors]
    floor = claims.against_floor(kld_ih, [kld for kld, _, _ in pairs], windows, margin)
    same_floor = np.mean([same.astype(np.float64) for _, same, _ in pairs], axis=0)
    below = same_floor - same_ih.astype(np.float64)
    return {
        "kld_hf_floor": floor.mean.value,
        "kld_hf_floor_stderr_window": metrics.clustered_stderr(floor.kld, windows),
        "kld_hf_floor_draws": floor.draws,
        "kld_hf_floor_draw_spread": floor.draw_spread,
        "same_top_hf_floor": float(np.mean(same_floor)),
        "same_top_hf_floor_stderr_window": metrics.clustered_stderr(same_floor, windows),
        "kld_int_vs_hf_floor_ratio": floor.ratio,
        "kld_int_vs_hf_above_floor": floor.excess.value,
        "kld_int_vs_hf_above_floor_stderr_window": floor.excess_stderr,
        **floor.metrics("kld_int_vs_hf", "int_vs_hf_floor"),
        "same_top_int_vs_hf_below_floor": float(np.mean(below)),
        "same_top_int_vs_hf_below_floor_stderr_window": metrics.clustered_stderr(below, windows),
    }
