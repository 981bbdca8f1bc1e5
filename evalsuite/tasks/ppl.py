"""Perplexity and next-token agreement on fixed windows of a text (the WikiText-2 protocol)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from evalsuite import claims, metrics, plots
from evalsuite.observation import Observation
from evalsuite.observers.compact_window_logits import (
    REFERENCE_LABEL,
    detail_at_reference,
    is_at_reference,
    long_window_needs,
)
from evalsuite.observers.kld_detail import (
    Precision,
    detail_metrics,
    floor_metrics,
    token_detail,
    write_tokens,
)
from evalsuite.observers.noise_floor import NoiseFloorOptions, NoisyLogitsAtReference, NoisyWindowLogits
from evalsuite.observers.paired_window_logits import PairedWindowLogits, is_paired, paired_detail
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
from evalsuite.side import Side
from evalsuite.spec import StrictModel, TaskSpec
from evalsuite.task import Difference, Inputs, Need, RunContext, TaskResult, clustered_difference, task
from evalsuite.tasks.long_context import (
    LongContext,
    check_long_windows,
    position_bucket_metrics,
    scored_positions,
)


class CompareOptions(StrictModel):
    kld_chunk_rows: int = 16
    # float32: every per-token statistic from one pass over each row in float32 with float64 sums
    # (`evalsuite.logit_rows`; kld_mean within 1e-4 relative of the float64 definition, a test holds it);
    # float64: the definition's own arithmetic, slower.
    precision: Precision = "float32"


class PplSpec(TaskSpec):
    protocol: WindowProtocol = WindowProtocol()
    record: RecordOptions = RecordOptions()
    compare: CompareOptions = CompareOptions()
    long_context: LongContext = LongContext()
    noise_floor: NoiseFloorOptions = NoiseFloorOptions()


@task("ppl")
class Perplexity:
    """PPL of each side, ln(PPL ratio), KL divergence, same-top-token rate and Δp on the scored tokens."""

    spec_model: ClassVar[type[TaskSpec]] = PplSpec
    metric_names: ClassVar[tuple[str, ...]] = (
        "n_windows",
        "n_scored_tokens",
        "ppl_ref",
        "ppl_ckpt",
        "ppl_ratio",
        "ln_ppl_ratio",
        "kld_mean",
        "kld_median",
        "kld_p90",
        "kld_p99",
        "kld_p999",
        "kld_max",
        "same_top_p",
        "delta_p_mean",
        "rms_delta_p",
        "kld_reverse_mean",
        "top?_agreement",
        "delta_p_*",
        "kld_conf_*",
        "kld_floor",
        "kld_floor_ratio",
        "kld_above_floor",
        "kld_floor_allowed",
        "kld_beyond_allowed",
        "noise_floor",
        "kld_vs_ref_mde",
        "ln_ppl_ratio_mde",
        "*_upper95",
        "*_lower95",
    )

    metric_descriptions: ClassVar[dict[str, str]] = {
        "n_scored_tokens": "scored tokens per side (the sample size of every statistic below)",
        "ppl_ref": "perplexity of the reference on the scored tokens",
        "ppl_ckpt": "perplexity of the candidate on the same tokens",
        "ppl_ratio": "ppl_ckpt / ppl_ref, from the mean per-token NLL difference (paired by token)",
        "kld_mean": "mean KL(ref ‖ ckpt) of the next-token distributions over scored positions (nats)",
        "kld_p99": "99th percentile of the per-token KLD: how bad the worst 1% of tokens are",
        "same_top_p": "share of scored positions where both sides rank the same token first",
        "delta_p_mean": "mean change of the probability given to the true next token (ckpt − ref)",
        "rms_delta_p": "root mean square of that change: how much the probabilities move either way",
        "kld_estimator": "how KLD was computed: full vocabulary, or top-k + sampled tail from a recording",
        "kld_reverse_mean": "mean KL(ckpt ‖ ref): the divergence weighted by the candidate's own beliefs",
        "top5_agreement": "share of scored positions whose 5 most probable tokens agree, in order",
        "delta_p_p99": "99th percentile of the per-token Δp (llama.cpp's `99.0% Δp`)",
        "kld_conf_95_100_mean": "mean KLD where the reference gives its top token p >= 0.95",
        "kld_floor": "mean KLD of the reference run again with BF16-sized noise on each decoder layer",
        "kld_floor_ratio": "kld_mean / kld_floor: the candidate's divergence in units of the noise floor",
        "kld_vs_ref_mde": "the smallest mean KLD from the reference that a test of this candidate's kld_mean "
        "alone detects (two-sided 5%, 80% power, its window-clustered error, t with windows − 1 degrees of "
        "freedom): how precisely these windows measure one candidate, not how close two candidates may be "
        "and still be told apart (compare pairs them by token: its paired MDE is far smaller)",
        "ln_ppl_ratio_mde": "the smallest ln PPL ratio these windows detect (two-sided 5%, 80% power, "
        "per-token NLL differences paired by token, window-clustered, t with windows − 1 degrees of freedom)",
        "kld_above_floor": "mean per-token kld − the floor's KLD, paired by token",
        "kld_floor_margin": "the spec's [noise_floor] margin m: within the floor means a mean KLD of at most "
        "(1 + m) × the noise floor's KLD",
        "kld_floor_allowed": "the mean KLD a candidate within the floor may have: (1 + kld_floor_margin) × "
        "kld_floor",
        "kld_beyond_allowed": "mean per-token kld − (1 + margin) × the floor's KLD, paired by token: the "
        "statistic noise_floor is tested on (≤ 0 exactly when the candidate is within the allowed KLD)",
        "noise_floor": "within: the upper 95% bound of kld_beyond_allowed (window-clustered, t with "
        "windows − 1 degrees of freedom) is at most 0, the candidate's mean KLD shown to be at most "
        "(1 + margin) × the noise floor's; above: its lower bound exceeds 0; undetermined: neither is shown "
        "(or fewer than 3 windows)",
        "kld_floor_draw_spread": "max − min of the floor's mean KLD over its noise draws (seeds)",
    }

    def __init__(self, spec: PplSpec, context: RunContext) -> None:
        self.spec = spec
        self.context = context

    def prepare(self, ref: Side, ckpt: Side) -> Inputs:
        """The windows, tokenized once; the candidate's tokenizer must agree with the reference's."""
        inputs = prepare_windows(self.spec.protocol, self.context.corpus, ref, ckpt, self.context.shared)
        check_long_windows(self.spec.protocol, self.spec.long_context, inputs, [ref, ckpt])
        return inputs

    def needs(self) -> list[Need]:
        chunk_rows, head_rows = self.spec.compare.kld_chunk_rows, self.spec.long_context.head_chunk_rows
        if head_rows:
            needs = long_window_needs(self.spec.protocol, self.spec.record, chunk_rows, head_rows)
        else:
            observer = WindowLogits(self.spec.protocol, self.spec.record, chunk_rows)
            if self.spec.compare.precision == "float32":
                # Each candidate window compared with the reference's as it is made (paired_window_logits).
                paired = PairedWindowLogits(self.spec.protocol, self.spec.record, chunk_rows)
                needs = [
                    Need(REFERENCE_LABEL, "ref", observer),
                    Need("ckpt", "ckpt", paired, consumes=(REFERENCE_LABEL,), alone=observer),
                ]
            else:
                needs = [Need(REFERENCE_LABEL, "ref", observer), Need("ckpt", "ckpt", observer)]
        floor, protocol = self.spec.noise_floor, self.spec.protocol
        for i in range(floor.draws if floor.enabled else 0):
            if head_rows:  # as the candidate is observed on long windows: at the reference's ids
                at_ref = NoisyLogitsAtReference(protocol, chunk_rows, head_rows, noise=floor.draw(i))
                needs.append(Need(floor.label(i), "ref", at_ref, consumes=(REFERENCE_LABEL,)))
            else:
                noisy = NoisyWindowLogits(protocol, self.spec.record, chunk_rows, noise=floor.draw(i))
                needs.append(Need(floor.label(i), "ref", noisy))
        return needs

    def paired_differences(self, values: dict[str, Any]) -> list[Difference]:
        """The PPL (per-token NLL) and the true token's probability (Δp), each paired by token against the
        reference: what reports name where significant, whether or not a check covers them."""
        ppl = f"{Difference.figure(values.get('ppl_ref'))} → {Difference.figure(values.get('ppl_ckpt'))}"
        found = [
            clustered_difference(
                "PPL",
                f"{ppl} (ratio {Difference.figure(values.get('ppl_ratio'))})",
                "ln_ppl_ratio",
                values,
                True,
                "ppl_ratio",
            ),
            clustered_difference(
                "the true token's probability",
                f"mean Δp {Difference.figure(values.get('delta_p_mean'))}",
                "delta_p_mean",
                values,
                False,
                "rms_delta_p",
            ),
        ]
        return [d for d in found if d is not None]

    def compare(self, observed: Mapping[str, Observation], artifacts: Path) -> TaskResult:
        ref, ckpt = observed["ref"], observed["ckpt"]
        same_inputs({"ref": ref, "ckpt": ckpt})
        n_windows = ref.meta["n_windows"]
        nll_ref, nll_ckpt = ref.arrays["nll"], ckpt.arrays["nll"]
        windows = metrics.window_labels(n_windows, len(nll_ref) // n_windows)
        ln_ratio = metrics.paired_log_ratio(nll_ref, nll_ckpt)
        chunk_rows, spec, shared = self.spec.compare.kld_chunk_rows, self.spec.compare, self.context.shared
        if is_at_reference(ckpt):
            detail, kld, estimator = detail_at_reference(ref, ckpt)
        elif is_paired(ckpt):
            detail = paired_detail(ref, ckpt)
            kld, estimator = detail.kld, FULL_VOCABULARY
        elif (detail := token_detail(ref, ckpt, chunk_rows, spec.precision, shared)).kld is not None:
            kld, estimator = detail.kld, FULL_VOCABULARY
        else:
            kld, estimator = kld_per_token(ref, ckpt, chunk_rows)
        kld_mean = metrics.mean_with_stderr(kld)
        kld_q = metrics.quantiles(kld, (0.5, 0.9, 0.99, 0.999))
        same = detail.same_top if detail.same_top is not None else ref.arrays["top"] == ckpt.arrays["top"]
        same_top = metrics.rate_with_stderr(same)
        dp = metrics.delta_p(-nll_ref, -nll_ckpt)
        protocol = self.spec.protocol
        values: dict[str, Any] = {
            "corpus": ref.meta["corpus"],
            "window_tokens": protocol.window,
            "window_starts": ",".join(str(s) for s in ref.meta["window_starts"]),
            "scored_first": protocol.scored.first,
            "scored_last": protocol.scored.last,
            "n_windows": n_windows,
            "n_scored_tokens": len(nll_ref),
            "tokens_sha256": ref.meta["tokens_sha256"],
            **corpus_provenance(self.context),
            **ppl_summary("ref", nll_ref, n_windows),
            **ppl_summary("ckpt", nll_ckpt, n_windows),
            "ppl_ratio": float(np.exp(ln_ratio.value)),
            "ln_ppl_ratio": ln_ratio.value,
            "ln_ppl_ratio_stderr": ln_ratio.stderr,
            "ln_ppl_ratio_stderr_window": metrics.clustered_stderr(nll_ckpt - nll_ref, windows),
            "kld_mean": kld_mean.value,
            "kld_mean_stderr": kld_mean.stderr,
            "kld_mean_stderr_window": metrics.clustered_stderr(kld, windows),
            "kld_median": kld_q[0],
            "kld_p90": kld_q[1],
            "kld_p99": kld_q[2],
            "kld_p999": kld_q[3],
            "kld_max": float(kld.max()),
            "kld_estimator": estimator,
            "same_top_p": same_top.value,
            "same_top_p_stderr": same_top.stderr,
            "same_top_p_stderr_window": metrics.clustered_stderr(same, windows),
            "delta_p_mean": dp.mean.value,
            "delta_p_mean_stderr": dp.mean.stderr,
            "delta_p_mean_stderr_window": metrics.clustered_stderr(
                np.exp(-nll_ckpt) - np.exp(-nll_ref), windows
            ),
            "rms_delta_p": dp.rms.value,
            "rms_delta_p_stderr": dp.rms.stderr,
            "rms_delta_p_stderr_window": metrics.rms_clustered_stderr(
                np.exp(-nll_ckpt) - np.exp(-nll_ref), windows
            ),
            "ref_execution": ref.meta.get("execution", {}).get("execution", "recording"),
            "ckpt_execution": ckpt.meta.get("execution", {}).get("execution"),
        }
        if n_windows < protocol.starts.count:
            values["protocol_note"] = (
                f"text too short for the protocol: {n_windows} of {protocol.starts.count} windows fit "
                f"({ref.meta['n_tokens_text']} tokens)"
            )
        values.update(detail_metrics(detail, kld, nll_ref, nll_ckpt, windows))
        values.update(claim_metrics(values, n_windows))
        tokens = {"kld": kld, "nll_ref": nll_ref, "nll_ckpt": nll_ckpt, "window": windows}
        if "floor" in observed:
            floor_spec = self.spec.noise_floor
            draws = [observed[floor_spec.label(i)] for i in range(floor_spec.draws)]
            floor, tokens["kld_floor"] = floor_metrics(
                ref, draws, kld, windows, chunk_rows, floor_spec.margin, shared
            )
            values.update(floor)
        artifacts_made = self.plot(ref, nll_ckpt, kld, estimator, artifacts) if self.context.plots else {}
        long = self.spec.long_context
        if long.head_chunk_rows:
            values["head_chunk_rows"] = long.head_chunk_rows
            for label, obs in (("ref", ref), ("ckpt", ckpt)):
                if "bytes_per_token" in obs.meta:
                    values[f"{label}_stored_bytes_per_token"] = obs.meta["bytes_per_token"]
        if long.position_buckets:
            positions = scored_positions(protocol, n_windows)
            values.update(
                position_bucket_metrics(
                    long.position_buckets, positions, kld, same, nll_ref, nll_ckpt, windows=windows
                )
            )
            if self.context.plots:
                plots.kld_by_position(
                    positions, kld, long.position_buckets, artifacts / "ppl_kld_by_position.png", estimator
                )
                artifacts_made["kld_by_position"] = f"{artifacts.name}/ppl_kld_by_position.png"
        artifacts_made["tokens"] = write_tokens(artifacts, tokens)
        checks, _ = self.spec.threshold_checks(values)
        few = claims.too_few_reason(n_windows)
        undefined = [k for k, v in values.items() if isinstance(v, float) and math.isnan(v) and _claimed(k)]
        reasons = {k: few for k in undefined} if few else {}
        return TaskResult.from_checks(values, checks, artifacts=artifacts_made, null_reasons=reasons)

    def plot(
        self, ref: Observation, nll_ckpt: np.ndarray, kld: np.ndarray, estimator: str, folder: Path
    ) -> dict:
        """The KLD histogram and the per-window PPL of both sides; paths relative to the run folder."""
        n = ref.meta["n_windows"]
        ppl_ref = [metrics.perplexity(w) for w in np.split(ref.arrays["nll"], n)]
        ppl_ckpt = [metrics.perplexity(w) for w in np.split(nll_ckpt, n)]
        plots.kld_histogram(kld, folder / "ppl_kld_histogram.png", estimator, title="KL(ref ‖ ckpt)")
        plots.window_ppl(ppl_ref, ppl_ckpt, ref.meta["window_starts"], folder / "ppl_window_ppl.png")
        return {
            "kld_histogram": f"{folder.name}/ppl_kld_histogram.png",
            "window_ppl": f"{folder.name}/ppl_window_ppl.png",
        }


def _claimed(name: str) -> bool:
    """Whether a metric is a claim (`evalsuite.claims`) that needs enough windows: a bound, an MDE."""
    return name.endswith(("_upper95", "_lower95", "_mde"))


def claim_metrics(values: dict[str, Any], n_windows: int) -> dict[str, float]:
    """What the main figures let a report claim (`evalsuite.claims`): one-sided 95% bounds of `kld_mean`,
    `same_top_p` and `ppl_ratio` (from ln_ppl_ratio's), the smallest mean KLD from the reference a test of
    `kld_mean` alone detects with 80% power (`kld_vs_ref_mde`: one candidate's error, not a pair's), and
    the smallest `ln_ppl_ratio` these windows detect. NaN, with fewer than 3 windows."""
    out: dict[str, float] = {}
    for name in ("kld_mean", "same_top_p"):
        se = values[f"{name}_stderr_window"]
        for which in ("upper95", "lower95"):
            out[f"{name}_{which}"] = claims.bound(values[name], se, n_windows, which)
    ln_se = values["ln_ppl_ratio_stderr_window"]
    for which in ("upper95", "lower95"):
        ln_bound = claims.bound(values["ln_ppl_ratio"], ln_se, n_windows, which)
        out[f"ppl_ratio_{which}"] = float(np.exp(ln_bound))
    out["kld_vs_ref_mde"] = claims.minimum_detectable_effect(values["kld_mean_stderr_window"], n_windows)
    out["ln_ppl_ratio_mde"] = claims.minimum_detectable_effect(ln_se, n_windows)
    return out


def corpus_provenance(context: RunContext) -> dict[str, str]:
    """For results.json: the sha256 of the text the tokens were made from, where it was read, and why `auto`
    fell back from WikiText-2 when it did."""
    corpus = context.corpus
    values = {"corpus_sha256": corpus.sha256}
    if corpus.source is not None:
        values["corpus_source"] = corpus.source
    if corpus.fallback is not None:
        values["corpus_fallback"] = corpus.fallback
    return values
