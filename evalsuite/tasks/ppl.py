"""Perplexity and next-token agreement on fixed windows of a text (the WikiText-2 protocol), or on the
assistant turns of chats through the chat template (`[chats]`, `--chats`: `evalsuite.tasks.chats`); with the
calibration set kept apart (`--calibration`: `evalsuite.tasks.calibration_overlap`)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from evalsuite.contract.observation import Observation
from evalsuite.contract.spec import Check, StrictModel, TaskSpec
from evalsuite.observers.chat_logits import CHAT_TAGS, is_chat_observation
from evalsuite.observers.compact_window_logits import (
    REFERENCE_LABEL,
    detail_at_reference,
    is_at_reference,
    long_window_needs,
)
from evalsuite.observers.execution_floor import (
    EXECUTION_FLOOR_LABEL,
    ExecutionFloorLogits,
    execution_floor_metrics,
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
from evalsuite.plotting import plots
from evalsuite.protocol.side import Side
from evalsuite.protocol.task import (
    Difference,
    Inputs,
    Need,
    RunContext,
    TaskResult,
    clustered_difference,
    task,
)
from evalsuite.stats import claims, metrics
from evalsuite.tasks.calibration_overlap import (
    CalibrationOptions,
    Overlap,
    calibration_overlap,
    flagged_verdicts,
    overlap_metrics,
    overlap_rows,
)
from evalsuite.tasks.chats import (
    ChatOptions,
    chat_file,
    chat_needs,
    chat_sequences,
    prepare_chats,
    split_checks,
    split_metrics,
    split_rows,
)
from evalsuite.tasks.long_context import (
    LongContext,
    check_long_windows,
    position_bucket_metrics,
    scored_positions,
)
from evalsuite.tasks.ppl_subsets import subset_checks, subset_metrics, with_claims


class CompareOptions(StrictModel):
    kld_chunk_rows: int = 16
    # float32: every per-token statistic from one pass over each row in float32 with float64 sums
    # (`evalsuite.stats.logit_rows`; kld_mean within 1e-4 relative of the float64 definition, a test holds
    # it); float64: the definition's own arithmetic, slower.
    precision: Precision = "float32"


class PplSpec(TaskSpec):
    protocol: WindowProtocol = WindowProtocol()
    record: RecordOptions = RecordOptions()
    compare: CompareOptions = CompareOptions()
    long_context: LongContext = LongContext()
    noise_floor: NoiseFloorOptions = NoiseFloorOptions()
    # Chats through the chat template instead of windows of a text (tasks/ppl-chat.toml; `--chats FILE`).
    chats: ChatOptions | None = None
    # Compare-only: it reads the calibration set against the inputs, and shapes no observation.
    calibration: CalibrationOptions = CalibrationOptions()

    COMPARE_ONLY: ClassVar[frozenset[str]] = TaskSpec.COMPARE_ONLY | {"calibration"}


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
        "execution_floor*",
        "kld_vs_ref_mde",
        "ln_ppl_ratio_mde",
        "*_upper95",
        "*_lower95",
        "n_chats",
        "tag_*",
        "turn_*",
        "clean_*",
        "calibration_*",
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
        "execution_floor_kld_mean": "mean KLD of the reference from itself with its windows batched "
        "(`--execution-floor`; on CUDA another kernel setting too): the reference's own execution difference",
        "execution_floor_same_top_p": "share of scored positions where the reference ranks the same token "
        "first both ways",
        "execution_floor_excess": "mean per-token kld − the reference's own execution KLD, paired by token",
        "execution_floor": "within: the upper 95% bound of execution_floor_excess (window-clustered) is at "
        "most 0, the candidate's difference no larger than the reference's from itself; above: its lower "
        "bound exceeds 0; undetermined: neither is shown",
        "n_chats": "chats scored (each one cluster of every error, as a window is on a text)",
        "assistant_spans": "how each chat's assistant tokens were found: the chat template's generation "
        "markers, or its rendering of each turn (the chat up to it with the generation prompt)",
        "calibration_overlap_share": "share of the scored text's tokens in a 13-gram the calibration set "
        "holds",
        "calibration_flagged_windows": "windows whose overlap with the calibration set exceeds the spec's "
        "share; clean_* are the figures (and checks) without them",
        "calibration_flagged_chats": "chats whose overlap with the calibration set exceeds the spec's share; "
        "clean_* are the figures (and checks) without them",
    }

    def __init__(self, spec: PplSpec, context: RunContext) -> None:
        self.spec = spec
        self.context = context
        self.chats = chat_file(spec.chats, context)
        # The overlap of each window (or chat) with the calibration set, found by `prepare`.
        self.overlap: Overlap | None = None

    def prepare(self, ref: Side, ckpt: Side) -> Inputs:
        """The windows (or the chats, through the chat template), tokenized once; the candidate's tokenizer
        (and chat template) must agree with the reference's. Their overlap with the calibration set, if one
        is given or named."""
        if self.chats is not None:
            inputs = prepare_chats(self.chats, ref, ckpt)
            sequences, unit, labels = chat_sequences(inputs), "chat", inputs[CHAT_TAGS]
        else:
            inputs = prepare_windows(self.spec.protocol, self.context.corpus, ref, ckpt, self.context.shared)
            check_long_windows(self.spec.protocol, self.spec.long_context, inputs, [ref, ckpt])
            sequences, unit = list(inputs["windows"]), "window"
            labels = [f"tokens {s}..{s + self.spec.protocol.window - 1}" for s in inputs["starts"]]
        self.overlap = calibration_overlap(
            self.spec.calibration, self.context, ref, ckpt, sequences, unit, labels
        )
        return inputs

    def needs(self) -> list[Need]:
        chunk_rows, head_rows = self.spec.compare.kld_chunk_rows, self.spec.long_context.head_chunk_rows
        if self.chats is not None:
            # No noise floor on chats: its perturbed passes run a text's windows.
            return chat_needs(self.spec.record, chunk_rows, self.spec.chats or ChatOptions())
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
        if self.context.execution_floor and not head_rows:
            # The reference against itself, its windows batched: compared with its own files as it is made.
            batched = ExecutionFloorLogits(protocol, self.spec.record, chunk_rows)
            needs.append(Need(EXECUTION_FLOOR_LABEL, "ref", batched, consumes=(REFERENCE_LABEL,)))
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
        nll_ref, nll_ckpt = ref.arrays["nll"], ckpt.arrays["nll"]
        chunk_rows, spec, shared = self.spec.compare.kld_chunk_rows, self.spec.compare, self.context.shared
        chats = is_chat_observation(ref)
        if chats:
            # Each chat is one cluster of every error, as a window is of a text.
            n_windows, windows = int(ref.meta["n_chats"]), ref.arrays["chat"].astype(np.int64)
            detail, kld, _ = detail_at_reference(ref, ckpt)
            estimator = (
                f"top-{ref.meta['top_k']} exact + {ref.meta['tail_samples']} sampled tail ids "
                "(the reference's compact form, chats)"
            )
        else:
            n_windows = ref.meta["n_windows"]
            windows = metrics.window_labels(n_windows, len(nll_ref) // n_windows)
            if is_at_reference(ckpt):
                detail, kld, estimator = detail_at_reference(ref, ckpt)
            elif is_paired(ckpt):
                detail = paired_detail(ref, ckpt)
                kld, estimator = detail.kld, FULL_VOCABULARY
            elif (detail := token_detail(ref, ckpt, chunk_rows, spec.precision, shared)).kld is not None:
                kld, estimator = detail.kld, FULL_VOCABULARY
            else:
                kld, estimator = kld_per_token(ref, ckpt, chunk_rows)
        same = detail.same_top if detail.same_top is not None else ref.arrays["top"] == ckpt.arrays["top"]
        values = self.chat_header(ref) if chats else self.window_header(ref)
        values.update(scored_values(nll_ref, nll_ckpt, kld, estimator, same, windows))
        values["ref_execution"] = ref.meta.get("execution", {}).get("execution", "recording")
        values["ckpt_execution"] = ckpt.meta.get("execution", {}).get("execution")
        protocol = self.spec.protocol
        if not chats and n_windows < protocol.starts.count:
            values["protocol_note"] = (
                f"text too short for the protocol: {n_windows} of {protocol.starts.count} windows fit "
                f"({ref.meta['n_tokens_text']} tokens)"
            )
        values.update(detail_metrics(detail, kld, nll_ref, nll_ckpt, windows))
        values.update(claim_metrics(values, n_windows))
        tokens = {"kld": kld, "nll_ref": nll_ref, "nll_ckpt": nll_ckpt, "window": windows}
        if chats:
            tokens.update(turn=ref.arrays["turn"], target=ref.arrays["target"])
        if "floor" in observed:
            floor_spec = self.spec.noise_floor
            draws = [observed[floor_spec.label(i)] for i in range(floor_spec.draws)]
            floor, tokens["kld_floor"] = floor_metrics(
                ref, draws, kld, windows, chunk_rows, floor_spec.margin, shared
            )
            values.update(floor)
        unmeasured: dict[str, str] = {}
        if EXECUTION_FLOOR_LABEL in observed:
            found, unmeasured = execution_floor_metrics(ref, observed[EXECUTION_FLOOR_LABEL], kld, windows)
            values.update(found)
        artifacts_made = {}
        if self.context.plots:
            artifacts_made = self.plot(ref, nll_ckpt, kld, estimator, artifacts, windows_too=not chats)
        long = self.spec.long_context
        if long.head_chunk_rows and not chats:
            values["head_chunk_rows"] = long.head_chunk_rows
            for label, obs in (("ref", ref), ("ckpt", ckpt)):
                if "bytes_per_token" in obs.meta:
                    values[f"{label}_stored_bytes_per_token"] = obs.meta["bytes_per_token"]
        if long.position_buckets and not chats:
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
        details: list[dict[str, Any]] = []
        if chats:
            min_chats = (self.spec.chats or ChatOptions()).min_split_chats
            splits = split_metrics(
                ref.meta["chat_tags"], windows, ref.arrays["turn"], kld, same, nll_ref, nll_ckpt, min_chats
            )
            by_split = split_checks(self.spec, splits)
            for name in splits:
                values.update(splits[name])
                checks += by_split[name]
            details += split_rows(splits, by_split)
        if self.overlap is not None:
            values.update(overlap_metrics(self.overlap))
            clean, clean_checks = self.without_flagged(values, windows, kld, same, nll_ref, nll_ckpt)
            values.update(clean)
            checks += clean_checks
            details += overlap_rows(self.overlap)
        few = claims.too_few_reason(n_windows)
        undefined = [k for k, v in values.items() if isinstance(v, float) and math.isnan(v) and _claimed(k)]
        reasons = {**unmeasured, **({k: few for k in undefined} if few else {})}
        return TaskResult.from_checks(
            values, checks, artifacts=artifacts_made, null_reasons=reasons, details=details
        )

    def window_header(self, ref: Observation) -> dict[str, Any]:
        """What results.json says first of the windows scored: the protocol and the text."""
        protocol = self.spec.protocol
        return {
            "corpus": ref.meta["corpus"],
            "window_tokens": protocol.window,
            "window_starts": ",".join(str(s) for s in ref.meta["window_starts"]),
            "scored_first": protocol.scored.first,
            "scored_last": protocol.scored.last,
            "n_windows": ref.meta["n_windows"],
            "n_scored_tokens": len(ref.arrays["nll"]),
            "tokens_sha256": ref.meta["tokens_sha256"],
            **corpus_provenance(self.context),
        }

    @staticmethod
    def chat_header(ref: Observation) -> dict[str, Any]:
        """What results.json says first of the chats scored: how many, their tags, how their assistant tokens
        were found. `n_windows` is the chat count: the clusters of every error, as windows are of a text."""
        return {
            "corpus": ref.meta["corpus"],
            "n_chats": ref.meta["n_chats"],
            "n_windows": ref.meta["n_chats"],
            "chat_tags": ",".join(dict.fromkeys(ref.meta["chat_tags"])),
            "assistant_spans": ref.meta["assistant_spans"],
            "n_scored_tokens": len(ref.arrays["nll"]),
            "tokens_sha256": ref.meta["tokens_sha256"],
        }

    def without_flagged(
        self,
        values: dict[str, Any],
        windows: np.ndarray,
        kld: np.ndarray,
        same: np.ndarray,
        nll_ref: np.ndarray,
        nll_ckpt: np.ndarray,
    ) -> tuple[dict[str, Any], list[Check]]:
        """The figures and the checks without the windows (or chats) the calibration set overlaps
        (`clean_…`), where some are flagged; and the verdict with and without them."""
        assert self.overlap is not None
        flagged = self.overlap.flagged
        if not flagged.any():
            return {}, []
        keep = ~flagged[windows]
        if not keep.any():
            return {"clean_note": f"every {self.overlap.unit} overlaps the calibration set"}, []
        clean = subset_metrics("clean", keep, kld, same, nll_ref, nll_ckpt, windows)
        clean = with_claims("clean", clean, len(np.unique(windows[keep])))
        checks = subset_checks(self.spec, "clean", clean)
        with_them, _ = self.spec.threshold_checks(values)
        return {**clean, **flagged_verdicts(with_them, checks)}, checks

    def plot(
        self,
        ref: Observation,
        nll_ckpt: np.ndarray,
        kld: np.ndarray,
        estimator: str,
        folder: Path,
        windows_too: bool = True,
    ) -> dict:
        """The KLD histogram and (on windows) the per-window PPL of both sides; paths relative to the run
        folder."""
        plots.kld_histogram(kld, folder / "ppl_kld_histogram.png", estimator, title="KL(ref ‖ ckpt)")
        made = {"kld_histogram": f"{folder.name}/ppl_kld_histogram.png"}
        if windows_too:
            n = ref.meta["n_windows"]
            ppl_ref = [metrics.perplexity(w) for w in np.split(ref.arrays["nll"], n)]
            ppl_ckpt = [metrics.perplexity(w) for w in np.split(nll_ckpt, n)]
            plots.window_ppl(ppl_ref, ppl_ckpt, ref.meta["window_starts"], folder / "ppl_window_ppl.png")
            made["window_ppl"] = f"{folder.name}/ppl_window_ppl.png"
        return made


def scored_values(
    nll_ref: np.ndarray,
    nll_ckpt: np.ndarray,
    kld: np.ndarray,
    estimator: str,
    same: np.ndarray,
    windows: np.ndarray,
) -> dict[str, Any]:
    """The main figures of the scored tokens (PPL of each side, their ratio, KLD and its percentiles, the
    same-top rate, Δp), each with its per-token and its clustered standard error (`windows`: each token's
    window, or chat)."""
    ln_ratio = metrics.paired_log_ratio(nll_ref, nll_ckpt)
    kld_mean = metrics.mean_with_stderr(kld)
    kld_q = metrics.quantiles(kld, (0.5, 0.9, 0.99, 0.999))
    same_top = metrics.rate_with_stderr(same)
    dp = metrics.delta_p(-nll_ref, -nll_ckpt)
    delta_p = np.exp(-nll_ckpt) - np.exp(-nll_ref)
    return {
        **ppl_summary("ref", nll_ref, labels=windows),
        **ppl_summary("ckpt", nll_ckpt, labels=windows),
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
        "delta_p_mean_stderr_window": metrics.clustered_stderr(delta_p, windows),
        "rms_delta_p": dp.rms.value,
        "rms_delta_p_stderr": dp.rms.stderr,
        "rms_delta_p_stderr_window": metrics.rms_clustered_stderr(delta_p, windows),
    }


def _claimed(name: str) -> bool:
    """Whether a metric is a claim (`evalsuite.stats.claims`) that needs enough windows: a bound, an MDE."""
    return name.endswith(("_upper95", "_lower95", "_mde"))


def claim_metrics(values: dict[str, Any], n_windows: int) -> dict[str, float]:
    """What the main figures let a report claim (`evalsuite.stats.claims`): one-sided 95% bounds of
    `kld_mean`,
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
