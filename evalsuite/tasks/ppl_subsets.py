"""`ppl`'s figures on a subset of its scored tokens: a bucket of positions in a long window, the chats of one
tag, the assistant turns of one rank, the windows clear of the calibration set. Each mean and share has its
error clustered by the subset's own windows (or chats), and a subset that states a verdict gets the spec's
thresholds applied to its own figures (`subset_checks`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from evalsuite.contract.spec import Check, TaskSpec, apply_threshold
from evalsuite.stats import claims, metrics


def subset_metrics(
    name: str,
    mask: np.ndarray,
    kld: np.ndarray,
    same_top: np.ndarray,
    nll_ref: np.ndarray,
    nll_ckpt: np.ndarray,
    clusters: np.ndarray | None = None,
) -> dict[str, float | int]:
    """The subset `mask`'s token count, mean KLD with its standard error, same-top-token rate, mean Δp, RMS
    Δp and ln PPL ratio, each named `NAME_…`; with the tokens' `clusters` (their windows or chats), the
    clustered error of each mean and share (`_stderr_window`: NaN with fewer than two clusters)."""
    kld_mean = metrics.mean_with_stderr(kld[mask])
    same = metrics.rate_with_stderr(same_top[mask])
    dp = metrics.delta_p(-nll_ref[mask], -nll_ckpt[mask])
    ln_ratio = metrics.paired_log_ratio(nll_ref[mask], nll_ckpt[mask])
    values: dict[str, float | int] = {
        f"{name}_n_tokens": int(mask.sum()),
        f"{name}_kld_mean": kld_mean.value,
        f"{name}_kld_mean_stderr": kld_mean.stderr,
        f"{name}_same_top_p": same.value,
        f"{name}_delta_p_mean": dp.mean.value,
        f"{name}_rms_delta_p": dp.rms.value,
        f"{name}_ln_ppl_ratio": ln_ratio.value,
    }
    if clusters is not None:
        labels = clusters[mask]
        delta_p = np.exp(-nll_ckpt[mask]) - np.exp(-nll_ref[mask])
        values.update(
            {
                f"{name}_kld_mean_stderr_window": metrics.clustered_stderr(kld[mask], labels),
                f"{name}_same_top_p_stderr_window": metrics.clustered_stderr(same_top[mask], labels),
                f"{name}_delta_p_mean_stderr_window": metrics.clustered_stderr(delta_p, labels),
                f"{name}_rms_delta_p_stderr_window": metrics.rms_clustered_stderr(delta_p, labels),
                f"{name}_ln_ppl_ratio_stderr_window": metrics.clustered_stderr(
                    nll_ckpt[mask] - nll_ref[mask], labels
                ),
            }
        )
    return values


def with_claims(name: str, values: dict[str, float | int], clusters: int) -> dict[str, float | int]:
    """A subset's `subset_metrics` (clustered) with what a verdict on it needs: its cluster count
    (`NAME_n_windows`), its PPL ratio, and the one-sided 95% bounds of its mean KLD, same-top rate and PPL
    ratio (t with its own `clusters` − 1 degrees of freedom; NaN with fewer than `claims.MIN_CLUSTERS`)."""
    values[f"{name}_n_windows"] = clusters
    values[f"{name}_ppl_ratio"] = float(np.exp(values[f"{name}_ln_ppl_ratio"]))
    for which in ("upper95", "lower95"):
        for metric in ("kld_mean", "same_top_p"):
            se = float(values[f"{name}_{metric}_stderr_window"])
            values[f"{name}_{metric}_{which}"] = claims.bound(
                float(values[f"{name}_{metric}"]), se, clusters, which
            )
        ln_se = float(values[f"{name}_ln_ppl_ratio_stderr_window"])
        ln_bound = claims.bound(float(values[f"{name}_ln_ppl_ratio"]), ln_se, clusters, which)
        values[f"{name}_ppl_ratio_{which}"] = float(np.exp(ln_bound))
    return values


def subset_checks(spec: TaskSpec, name: str, values: dict[str, Any]) -> list[Check]:
    """The spec's thresholds applied to a subset's figures (`NAME_metric`, from `with_claims`), each
    check named after the subset's metric; a threshold on a metric the subset has not is left out."""
    checks: list[Check] = []
    # A bound the subset does not report itself is computed from its own clusters, not the task's.
    own = {**values, "n_windows": values.get(f"{name}_n_windows")}
    for metric, threshold in spec.thresholds.items():
        key = f"{name}_{metric}"
        if key in values:
            checks += apply_threshold(key, values[key], threshold, own)
    return checks
