"""The KLD detail of `ppl`: reverse KL, top-K agreement, the reference's confidence buckets, Δp percentiles,
and the noise floor; and the per-token arrays `compare` pairs candidates by (`ppl_tokens.npz`).

Computed from the two observations' files a few rows at a time, like the forward KLD (`window_logits`).
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from evalsuite import metrics
from evalsuite.observation import Observation
from evalsuite.run_folder import write_atomic
from evalsuite.tasks.logits_file import read_rows
from evalsuite.tasks.window_logits import check_same_shape, kld_per_token, log_softmax64, window_paths

TOP_K_AGREEMENT = 5  # top-K agreement is reported for K = 1 .. 5
TOKENS_ARTIFACT = "ppl_tokens.npz"


@dataclass
class TokenDetail:
    """Per scored token: the reference's top-1 probability, both sides' ranked top tokens, KL(ckpt ‖ ref)
    (None against a recording, which holds the reference's top-k only), and KL(ref ‖ ckpt) where it came
    from the same pass over the logits (None against a recording: `kld_per_token` estimates it)."""

    ref_top_p: np.ndarray
    top_ref: np.ndarray
    top_ckpt: np.ndarray
    reverse_kld: np.ndarray | None
    kld: np.ndarray | None = None


def token_detail(ref: Observation, ckpt: Observation, chunk_rows: int) -> TokenDetail:
    """The per-token detail of two observations (the reference possibly recorded). Against a live reference
    both sides' logits are read and normalised once for every statistic, the forward KLD included: the same
    arithmetic as `kld_per_token`, row for row, at a third of the reads and log-softmaxes."""
    k = TOP_K_AGREEMENT
    if ref.meta.get("kind") == "recorded":
        top_ckpt = [
            block.double().topk(k, dim=-1).indices.numpy()
            for block in read_rows(window_paths(ckpt), chunk_rows)
        ]
        a = ref.arrays
        conf = np.exp(a["top_logp"][:, 0].astype(np.float64))
        return TokenDetail(conf, a["top_ids"][:, :k], np.concatenate(top_ckpt), None)
    conf, top_ref, top_ckpt, forward, reverse = [], [], [], [], []
    pairs = zip(
        read_rows(window_paths(ref), chunk_rows), read_rows(window_paths(ckpt), chunk_rows), strict=True
    )
    for x, y in pairs:
        check_same_shape(x, y)
        y64 = y.double()
        top_ckpt.append(y64.topk(k, dim=-1).indices.numpy())
        lp_ref, lp_ckpt = log_softmax64(x), torch.log_softmax(y64, dim=-1)
        top = lp_ref.topk(k, dim=-1)
        conf.append(top.values[:, 0].exp().numpy())
        top_ref.append(top.indices.numpy())
        lp_ref_np, lp_ckpt_np = lp_ref.numpy(), lp_ckpt.numpy()
        forward.append(metrics.kl_divergence(lp_ref_np, lp_ckpt_np))
        reverse.append(metrics.kl_divergence(lp_ckpt_np, lp_ref_np))
    return TokenDetail(
        np.concatenate(conf),
        np.concatenate(top_ref),
        np.concatenate(top_ckpt),
        np.concatenate(reverse),
        np.concatenate(forward),
    )


def _bucket_name(lo: float, hi: float) -> str:
    return f"kld_conf_{round(lo * 100)}_{round(hi * 100)}"


def detail_metrics(
    detail: TokenDetail, kld: np.ndarray, nll_ref: np.ndarray, nll_ckpt: np.ndarray, windows: np.ndarray
) -> dict[str, Any]:
    """The KLD detail metrics, each with its standard error where one exists (per token, and clustered by
    window for means)."""
    values: dict[str, Any] = {}
    if detail.reverse_kld is not None:
        rev = metrics.mean_with_stderr(detail.reverse_kld)
        values.update(
            kld_reverse_mean=rev.value,
            kld_reverse_mean_stderr=rev.stderr,
            kld_reverse_mean_stderr_window=metrics.clustered_stderr(detail.reverse_kld, windows),
        )
    for k in range(1, TOP_K_AGREEMENT + 1):
        agree = metrics.top_k_agreement(detail.top_ref, detail.top_ckpt, k)
        values[f"top{k}_agreement"] = agree.value
        values[f"top{k}_agreement_stderr"] = agree.stderr
    dp = np.exp(-nll_ckpt) - np.exp(-nll_ref)
    values.update({f"delta_p_{name}": v for name, v in metrics.delta_p_percentiles(dp).items()})
    for bucket in metrics.confidence_buckets(kld, detail.ref_top_p):
        name = _bucket_name(bucket.lo, bucket.hi)
        values[f"{name}_share"] = bucket.share
        if bucket.mean is not None:
            values[f"{name}_mean"] = bucket.mean.value
            values[f"{name}_mean_stderr"] = bucket.mean.stderr
            values[f"{name}_median"] = bucket.median
    return values


def floor_metrics(
    ref: Observation, floor: Observation, kld: np.ndarray, windows: np.ndarray, chunk_rows: int
) -> tuple[dict[str, Any], np.ndarray]:
    """`kld_floor` (the noisy reference's KLD from the reference), the candidate's `kld_floor_ratio`, and
    whether it lies within the floor: its per-token excess over the floor, paired by token, no larger than
    1.96 window-clustered standard errors. Also the floor's per-token KLD."""
    floor_kld = _floor_kld(ref, floor, chunk_rows)
    est = metrics.mean_with_stderr(floor_kld)
    excess = metrics.paired_difference(floor_kld, kld)
    excess_se = metrics.clustered_stderr(kld - floor_kld, windows)
    kld_mean = float(np.mean(kld))
    within = excess.value <= 0 or not metrics.distinguishable(excess, excess_se)
    return {
        "kld_floor": est.value,
        "kld_floor_stderr": est.stderr,
        "kld_floor_stderr_window": metrics.clustered_stderr(floor_kld, windows),
        "kld_floor_ratio": metrics.ratio_to_floor(kld_mean, est.value),
        "kld_above_floor": excess.value,
        "kld_above_floor_stderr_window": excess_se,
        "within_noise_floor": bool(within),
    }, floor_kld


# The floor's per-token KLD by the two observations' keys: it is the reference's alone, the same for every
# candidate `compare` runs against it (one pass over two sides' logits each time otherwise).
_FLOOR_KLD: dict[tuple[str, str, int], np.ndarray] = {}
_FLOOR_KLD_KEEP = 4


def _floor_kld(ref: Observation, floor: Observation, chunk_rows: int) -> np.ndarray:
    if not (ref.key and floor.key):  # unkeyed observations (made by hand, say) are never shared
        return kld_per_token(ref, floor, chunk_rows)[0]
    key = (ref.key, floor.key, chunk_rows)
    if key not in _FLOOR_KLD:
        while len(_FLOOR_KLD) >= _FLOOR_KLD_KEEP:
            del _FLOOR_KLD[next(iter(_FLOOR_KLD))]
        _FLOOR_KLD[key] = kld_per_token(ref, floor, chunk_rows)[0]
        _FLOOR_KLD[key].setflags(write=False)
    return _FLOOR_KLD[key]


def write_tokens(folder: Path, arrays: dict[str, np.ndarray]) -> str:
    """The per-token arrays `compare` pairs candidates by, as one .npz (atomically); its path relative to
    the run folder."""
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    write_atomic(folder / TOKENS_ARTIFACT, buffer.getvalue())
    return f"{folder.name}/{TOKENS_ARTIFACT}"


def read_tokens(run_root: Path, relative: str) -> dict[str, np.ndarray]:
    """The per-token arrays of a run (no pickle: plain numeric arrays only)."""
    with np.load(run_root / relative, allow_pickle=False) as data:
        return {name: data[name] for name in data.files}
