"""The integer W4A8 reference execution of the candidate: its PPL, and how far stock Transformers is from it.

The `ppl` protocol (same windows, same scored positions, same tokens) observed three times: the reference as
usual, the candidate through backend `intref` (integer arithmetic reading the packed weights) and the same
candidate through backend `hf` (as Transformers runs it). The comparison reports the integer model's PPL
against the reference's, and the KL divergence and same-top-token rate between the two executions of the one
candidate, KL(P_int ‖ P_hf): the integer execution is the model the card describes, `hf` the approximation.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from evalsuite import metrics, plots
from evalsuite.backends.intref import ActivationSpec, unsupported_reason
from evalsuite.errors import InputError
from evalsuite.side import Side
from evalsuite.spec import TaskSpec
from evalsuite.task import Observation, TaskResult, TaskSkipped, task
from evalsuite.tasks.ppl import Perplexity, PplSpec


class IntrefSpec(PplSpec):
    """The `ppl` spec (protocol, record, compare) and the integer path's activation convention."""

    activations: ActivationSpec = ActivationSpec()


@task("intref")
class IntegerReference(Perplexity):
    """PPL of the integer W4A8 execution, and its KLD / same-top-token agreement with the `hf` execution."""

    roles: ClassVar[tuple[str, ...]] = ("ref", "ckpt@intref", "ckpt@hf")
    spec_model: ClassVar[type[TaskSpec]] = IntrefSpec
    spec: IntrefSpec

    def prepare(self, ref: Side, ckpt: Side) -> dict[str, Any]:
        """The `ppl` inputs; skipped, with the reason, for a candidate the integer path cannot execute.

        `evalsuite record` prepares one side as both (it records the reference, which needs no integer path).
        """
        reason = unsupported_reason(ckpt.checkpoint) if ckpt is not ref else None
        if reason is not None:
            raise TaskSkipped(reason)
        return super().prepare(ref, ckpt)

    def observe(self, side: Side, inputs: dict[str, Any], folder: Path) -> Observation:
        """The `ppl` observation; on the integer path also which integer layers and experts ran."""
        counters = getattr(side.model, "integer_counters", None)
        before = counters() if counters is not None else None
        obs = super().observe(side, inputs, folder)
        obs.task = self.name
        obs.meta["backend"] = side.options.backend
        if counters is not None:
            ran = {name for name, n in counters().items() if n > before.get(name, 0)}
            inventory = side.model.integer_inventory()
            obs.meta |= {
                # Experts are counted as `<experts module>.<e>`; Linear layers by their own names.
                "int_layers": sum(1 for name in ran if not name.rsplit(".", 1)[-1].isdigit()),
                "int_experts": sum(1 for name in ran if name.rsplit(".", 1)[-1].isdigit()),
                "int_layers_total": inventory["int_layers"],
                "int_experts_total": inventory["int_experts"],
                "activations": self.spec.activations.model_dump(),
            }
        return obs

    def compare(self, ref: Observation, ints: Observation, hf: Observation, artifacts: Path) -> TaskResult:
        for key in ("tokens_sha256", "vocab_size"):
            if not ref.meta[key] == ints.meta[key] == hf.meta[key]:
                raise InputError(
                    f"the observations were made on different inputs ({key}: "
                    f"{ref.meta[key]}, {ints.meta[key]}, {hf.meta[key]})"
                )
        if "int_layers" not in ints.meta:
            raise InputError(f"the `ckpt@intref` observation ran on backend {ints.meta.get('backend')!r}")
        nll_ref, nll_int, nll_hf = ref.arrays["nll"], ints.arrays["nll"], hf.arrays["nll"]
        ln_ratio = metrics.paired_log_ratio(nll_ref, nll_int)
        recorded = ref.meta.get("kind") == "recorded"
        kld_int = self.kld_from_recording(ref, ints) if recorded else self.kld_per_token(ref, ints)
        estimator = (
            f"top-{ref.meta['top_k']} exact + {ref.meta['tail_samples']} sampled tail ids (recording)"
            if recorded
            else "full-vocabulary"
        )
        kld_int_mean = metrics.mean_with_stderr(kld_int)
        same_top_int = metrics.same_top_rate(ref.arrays["top"], ints.arrays["top"])
        # KL(P_int ‖ P_hf): the integer execution is the distribution the card describes.
        kld_ih = self.kld_per_token(ints, hf)
        kld_ih_mean = metrics.mean_with_stderr(kld_ih)
        same_top_ih = metrics.same_top_rate(ints.arrays["top"], hf.arrays["top"])
        ppl = {
            name: metrics.perplexity(nll)
            for name, nll in (("ref", nll_ref), ("int", nll_int), ("hf", nll_hf))
        }
        values: dict[str, Any] = {
            "corpus": ref.meta["corpus"],
            "n_windows": ref.meta["n_windows"],
            "n_scored_tokens": len(nll_ref),
            "tokens_sha256": ref.meta["tokens_sha256"],
            "activation_divisor": ints.meta["activations"]["divisor"],
            "activation_rounding": ints.meta["activations"]["rounding"],
            "ppl_ref": ppl["ref"],
            "ppl_ref_stderr": ppl["ref"] * metrics.ln_perplexity(nll_ref).stderr,
            "ppl_int": ppl["int"],
            "ppl_int_stderr": ppl["int"] * metrics.ln_perplexity(nll_int).stderr,
            "ppl_int_ratio": float(np.exp(ln_ratio.value)),
            "ln_ppl_int_ratio": ln_ratio.value,
            "ln_ppl_int_ratio_stderr": ln_ratio.stderr,
            "ppl_hf": ppl["hf"],
            "ppl_hf_stderr": ppl["hf"] * metrics.ln_perplexity(nll_hf).stderr,
            "kld_int_mean": kld_int_mean.value,
            "kld_int_mean_stderr": kld_int_mean.stderr,
            "kld_int_estimator": estimator,
            "same_top_int": same_top_int.value,
            "same_top_int_stderr": same_top_int.stderr,
            "kld_int_vs_hf": kld_ih_mean.value,
            "kld_int_vs_hf_stderr": kld_ih_mean.stderr,
            "kld_int_vs_hf_p99": metrics.quantiles(kld_ih, (0.99,))[0],
            "kld_int_vs_hf_max": float(kld_ih.max()),
            "same_top_int_vs_hf": same_top_ih.value,
            "same_top_int_vs_hf_stderr": same_top_ih.stderr,
            "int_layers": ints.meta["int_layers"],
            "int_layers_total": ints.meta["int_layers_total"],
            "int_experts": ints.meta["int_experts"],
            "int_experts_total": ints.meta["int_experts_total"],
        }
        checks = self.spec.threshold_checks(values)
        plots.kld_histogram(kld_ih, artifacts / "intref_kld_int_vs_hf.png", "full-vocabulary, KL(int ‖ hf)")
        return TaskResult.from_checks(
            values,
            checks,
            artifacts={"kld_int_vs_hf_histogram": f"{artifacts.name}/intref_kld_int_vs_hf.png"},
        )
