"""The KLD detail of `ppl`: reverse KL, top-K agreement, the reference's confidence buckets, Δp percentiles,
and the noise floor; and the per-token arrays `compare` pairs candidates by (`ppl_tokens.npz`).

Computed from the two observations' files a few rows at a time, like the forward KLD (`window_logits`).
"""

from __future__ import annotations

import io
import itertools
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

import numpy as np
import torch

from evalsuite.contract.observation import Observation
from evalsuite.errors import InputError
from evalsuite.files.run_folder import write_atomic
from evalsuite.machine import largest_cache_bytes, usable_cores
from evalsuite.observers.logits_file import Header, read_header, read_rows
from evalsuite.observers.window_logits import check_same_shape, kld_per_token, numpy_rows, window_paths
from evalsuite.protocol.task import SharedWork
from evalsuite.stats import claims, logit_rows, metrics, token_ranks

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
    # Whether the sides' most probable tokens agree, ties included: some token is most probable on both
    # (`token_ranks.same_top_tied`), so that no way of breaking a tie among equal BF16 logits changes it.
    same_top: np.ndarray | None = None
    # Per token and K = 1 .. TOP_K_AGREEMENT, whether the K first tokens agree in order, ties included
    # (`token_ranks.top_k_hits_tied`); None where only the given rankings were kept (compared as ranked).
    top_hits: np.ndarray | None = None


Precision = Literal["float32", "float64"]


def token_detail(
    ref: Observation,
    ckpt: Observation,
    chunk_rows: int,
    precision: Precision = "float32",
    shared: SharedWork | None = None,
) -> TokenDetail:
    """The per-token detail of two observations (the reference possibly recorded). Against a live reference
    both sides' logits are read once and every statistic, the forward KLD included, comes from that one
    pass: in float32 with float64 sums (`logit_rows`, windows split between threads), or in float64 by the
    definition's arithmetic (`precision`). In float64, what it needs of a keyed reference's rows is kept in
    `shared` (`ReferenceRows`): the next candidate against the same reference gets the same bits without
    normalising or ranking the reference again."""
    k = TOP_K_AGREEMENT
    if ref.meta.get("kind") == "recorded":
        a = ref.arrays
        top_ckpt, hits, start = [], [], 0
        for block in read_rows(window_paths(ckpt), chunk_rows):
            rows = slice(start, start + len(block))
            start += len(block)
            top_ckpt.append(token_ranks.ranked_top(block.double().numpy(), k)[0])
            hits.append(top_hits_recorded(a["top_ids"][rows], a["top_logp"][rows], block, top_ckpt[-1]))
        conf = np.exp(a["top_logp"][:, 0].astype(np.float64))
        top_hits = np.concatenate(hits)
        return TokenDetail(
            conf,
            a["top_ids"][:, :k],
            np.concatenate(top_ckpt),
            None,
            same_top=top_hits[:, 0],  # column 0 is the same-top event
            top_hits=top_hits,
        )
    ref_paths, ckpt_paths = window_paths(ref), window_paths(ckpt)
    if len(ref_paths) != len(ckpt_paths):
        raise InputError(f"the sides hold {len(ref_paths)} and {len(ckpt_paths)} windows of logits")
    # Headers are read here, not in the threads (`read_rows` says why).
    ref_headers, ckpt_headers = [read_header(p) for p in ref_paths], [read_header(p) for p in ckpt_paths]
    if precision == "float64":
        return _detail64(
            ref, _WindowRun(ref_paths, ckpt_paths, ref_headers, ckpt_headers, 0, chunk_rows), shared
        )
    first_rows = np.cumsum([0] + [header[0][0] for header in ref_headers])
    # Each thread takes a contiguous run of windows, reads them itself and works through them a few rows at
    # a time; the shares are joined in row order. Per-row arithmetic: the same bits as one thread.
    bounds = np.linspace(0, len(ref_paths), detail_threads(len(ref_paths)) + 1).round().astype(int)
    parts = [
        _WindowRun(
            ref_paths[a:b],
            ckpt_paths[a:b],
            ref_headers[a:b],
            ckpt_headers[a:b],
            int(first_rows[a]),
            chunk_rows,
        )
        for a, b in itertools.pairwise(bounds)
        if b > a
    ]
    return detail_of_pairs(pairs_in_threads(_pair_windows, parts))


# Threads the float32 detail splits the windows between; None: one per core this process may use (no forward
# runs meanwhile). numpy's ufuncs run on the calling thread alone, so these threads keep the cores busy
# whatever torch's own thread count, which is left as it is (a process-wide setting).
DETAIL_THREADS: int | None = None


def detail_threads(parts: int) -> int:
    """How many threads the float32 detail of `parts` parts (windows, or runs of rows) runs on:
    `DETAIL_THREADS`, or the cores this process may use, at most one per part."""
    return max(1, min(DETAIL_THREADS or usable_cores(), parts))


def _detail64(ref: Observation, run: _WindowRun, shared: SharedWork | None) -> TokenDetail:
    """`token_detail` in float64, on the calling thread, with the reference's rows kept in `shared`."""
    key = ("reference-rows", ref.key)
    known = shared.find(key) if ref.key and shared is not None else None
    run.known = known
    share = _detail_windows(run)
    rows = known
    if rows is None:
        assert share.rows is not None
        rows = share.rows
        rows.finish()
        if ref.key and shared is not None:
            shared.put(key, rows)
    return TokenDetail(
        rows.conf,
        rows.top,
        np.concatenate(share.top_ckpt),
        np.concatenate(share.reverse),
        np.concatenate(share.forward),
        np.concatenate(share.same_top),
        np.concatenate(share.top_hits),
    )


# The bytes of the float32 detail's four row buffers, per thread; None: `float32_block_bytes`'s rule.
FLOAT32_BLOCK_BYTES: int | None = None


def float32_block_bytes() -> int:
    """How many bytes of rows the float32 detail works on at once in each thread: `FLOAT32_BLOCK_BYTES`, or
    the largest cache's share of each usable core, halved, within 4 to 16 MiB (8 MiB where the cache is not
    known). Why: blocks of a few rows pay numpy's per-call cost many times over, and two threads share the
    interpreter between calls; but where every thread's blocks together outgrow the shared cache, each
    pass over them goes to memory, and two threads then took more time and more CPU than one alone."""
    if FLOAT32_BLOCK_BYTES:
        return FLOAT32_BLOCK_BYTES
    cache = largest_cache_bytes()
    if cache is None:
        return 8 << 20
    return min(16 << 20, max(4 << 20, cache // (2 * usable_cores())))


# What the float32 detail keeps per row (`pairs_in_threads`): a `TokenDetail`'s arrays, by name, and the
# candidate's log-normaliser (its NLL, where its rows are compared as they are made).
PAIR_ARRAYS = ("kld", "reverse_kld", "ref_top_p", "top_ref", "top_ckpt", "top_hits", "ckpt_log_norm")
_Part = TypeVar("_Part")


def pairs_in_threads(
    work: Callable[[_Part], list[logit_rows.PairRows]], parts: list[_Part]
) -> dict[str, np.ndarray]:
    """`work` of each part (the `PairRows` of its rows, a few at a time), each part on a thread of its own
    (one part alone on this thread): `PAIR_ARRAYS`, joined in the parts' order."""
    if len(parts) == 1:
        shares = [work(parts[0])]
    else:
        with ThreadPoolExecutor(max_workers=len(parts), thread_name_prefix="kld-detail") as pool:
            shares = list(pool.map(work, parts))
    blocks = [block for share in shares for block in share]
    return {name: np.concatenate([getattr(block, name) for block in blocks]) for name in PAIR_ARRAYS}


def detail_of_pairs(arrays: Mapping[str, np.ndarray]) -> TokenDetail:
    """The `TokenDetail` of the float32 detail's arrays (`pairs_in_threads`, or a paired observation's)."""
    hits = arrays["top_hits"]
    return TokenDetail(
        arrays["ref_top_p"],
        arrays["top_ref"],
        arrays["top_ckpt"],
        arrays["reverse_kld"],
        arrays["kld"],
        same_top=hits[:, 0],  # column 0 is the same-top event
        top_hits=hits,
    )


def _pair_windows(run: _WindowRun) -> list[logit_rows.PairRows]:
    """The float32 statistics of a run of windows (`logit_rows.pair_statistics`), a few rows at a time."""
    pairs = zip(
        read_rows(run.ref_paths, run.chunk_rows, run.ref_headers),
        read_rows(run.ckpt_paths, run.chunk_rows, run.ckpt_headers),
        strict=True,
    )
    return pair_blocks(pairs)


def pair_blocks(pairs: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> list[logit_rows.PairRows]:
    """`logit_rows.pair_statistics` of successive blocks of both sides' rows (each block cut into a few rows
    at a time): per row the same bits however the rows come in blocks."""
    out: list[logit_rows.PairRows] = []
    scratch: logit_rows.RowScratch | None = None
    for block_ref, block_ckpt in pairs:
        check_same_shape(block_ref, block_ckpt)
        if scratch is None:
            vocab = block_ref.shape[-1]
            scratch = logit_rows.RowScratch(max(1, float32_block_bytes() // (16 * vocab)), vocab)
        x_raw, y_raw = numpy_rows(block_ref), numpy_rows(block_ckpt)
        for i in range(0, len(x_raw), scratch.rows):
            rows = slice(i, i + scratch.rows)
            out.append(logit_rows.pair_statistics(x_raw[rows], y_raw[rows], TOP_K_AGREEMENT, scratch))
    return out


@dataclass
class _Share:
    """What one thread computed of a block's rows, in row order."""

    top_ckpt: list[np.ndarray]
    forward: list[np.ndarray]
    reverse: list[np.ndarray]
    rows: ReferenceRows | None
    same_top: list[np.ndarray]
    top_hits: list[np.ndarray]


@dataclass
class _WindowRun:
    """Consecutive windows of both sides' logits files, the first of their rows row `start` of the
    observation: one thread's share of `token_detail`."""

    ref_paths: list[Path]
    ckpt_paths: list[Path]
    ref_headers: list[Header]
    ckpt_headers: list[Header]
    start: int
    chunk_rows: int
    known: ReferenceRows | None = None


def _detail_windows(run: _WindowRun) -> _Share:
    """`token_detail`'s statistics of a run of windows, read `chunk_rows` rows at a time into this thread's
    own buffers."""
    share = _Share([], [], [], None if run.known is not None else ReferenceRows.empty(), [], [])
    pairs = zip(
        read_rows(run.ref_paths, run.chunk_rows, run.ref_headers),
        read_rows(run.ckpt_paths, run.chunk_rows, run.ckpt_headers),
        strict=True,
    )
    work: _Workspace | None = None
    start = run.start
    for block_ref, block_ckpt in pairs:
        check_same_shape(block_ref, block_ckpt)
        work = work or _Workspace(block_ref.shape[-1])
        _detail_rows(block_ref, block_ckpt, start, work, run.known, share)
        start += len(block_ref)
    return share


def _detail_rows(
    x_rows: torch.Tensor,
    y_rows: torch.Tensor,
    start: int,
    work: _Workspace,
    known: ReferenceRows | None,
    share: _Share,
) -> None:
    """`token_detail`'s statistics of consecutive rows (reference rows `x`, candidate rows `y`, the first of
    them row `start` of the observation), a workspace's worth of rows at a time, appended to `share`."""
    k = TOP_K_AGREEMENT
    for i in range(0, len(x_rows), work.rows):
        x, y = x_rows[i : i + work.rows], y_rows[i : i + work.rows]
        y64, lp_ckpt, lp_ref, scratch = work.views(len(x))
        y64.copy_(y)
        share.top_ckpt.append(token_ranks.ranked_top(y64.numpy(), k)[0])
        torch.log_softmax(y64, dim=-1, out=lp_ckpt)
        x64 = y64.copy_(x)  # the candidate's float64 rows are done with
        if known is not None:
            lp_ref = known.log_softmax(x64, start + i)
        else:
            assert share.rows is not None
            share.rows.add(x64, k, out=lp_ref)
        top_ref = token_ranks.ranked_top(lp_ref.numpy(), k)[0]
        hits = token_ranks.top_k_hits_tied(lp_ref.numpy(), lp_ckpt.numpy(), top_ref, share.top_ckpt[-1])
        share.top_hits.append(hits)
        share.same_top.append(hits[:, 0])  # column 0 is the same-top event
        f, r = metrics.kl_divergence_both(lp_ref.numpy(), lp_ckpt.numpy(), scratch)
        share.forward.append(f)
        share.reverse.append(r)


# Rows are normalised this many bytes of float64 at a time: a few rows of a vocabulary stay in a core's L2
# cache through log-softmax, top-k and both KLD passes (16 rows of a 49 k vocabulary are 6 MB: every pass
# went to memory, a third slower on one machine), while each of the dozen torch and numpy calls per block
# still covers enough rows to pay for itself (one or two rows of a 49 k vocabulary did not: bench figures in
# the README). Per-row arithmetic: the numbers do not depend on it.
CACHE_BYTES = 2 << 20


class _Workspace:
    """The float64 buffers `token_detail` computes a few rows in, allocated once per call rather than five
    vocabulary-sized temporaries per row block."""

    def __init__(self, vocab: int) -> None:
        self.rows = max(1, CACHE_BYTES // (8 * vocab))
        self._torch = torch.empty((3, self.rows, vocab), dtype=torch.float64)
        self._numpy = np.empty((2, self.rows, vocab), dtype=np.float64)

    def views(self, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple[np.ndarray, np.ndarray]]:
        """Three tensors and the metrics' two scratch arrays, for `n` <= `rows` rows."""
        a, b, c = (t[:n] for t in self._torch)
        return a, b, c, (self._numpy[0, :n], self._numpy[1, :n])


@dataclass
class ReferenceRows:
    """What `token_detail` needs of the reference's rows and can keep for every candidate `compare` runs
    against it, 3 numbers and 5 ids per scored token rather than its vocabulary-sized log-probs: each
    row's maximum logit and log-normaliser, from which its float64 log-softmax is rebuilt bit for bit;
    its top-1 probability; its top tokens."""

    max_logit: torch.Tensor
    log_norm: torch.Tensor
    conf: np.ndarray
    top: np.ndarray
    rebuildable: bool = True
    _parts: dict[str, list[Any]] | None = None

    @classmethod
    def empty(cls) -> ReferenceRows:
        """Rows to be added, one block after another, by `add`."""
        return cls(torch.empty(0), torch.empty(0), np.empty(0), np.empty(0), _parts={"conf": [], "top": []})

    def add(self, x64: torch.Tensor, k: int, out: torch.Tensor) -> None:
        """The float64 log-softmax of the reference rows `x64` (their logits in float64, overwritten) into
        `out`, noting what later candidates need of them."""
        assert self._parts is not None
        lp = torch.log_softmax(x64, dim=-1, out=out)
        top_ids, top_values = token_ranks.ranked_top(lp.numpy(), k)
        top_lp = torch.from_numpy(top_values[:, :1].copy())
        # The top log-prob is x_max − max − log Σ exp(x − max) = −log Σ …: the normaliser comes free.
        max_logit = x64.amax(dim=-1, keepdim=True)
        log_norm = -top_lp
        if self.rebuildable:
            # torch's log-softmax on this machine must be (x − max) − log Σ, two roundings in this order,
            # for the rebuilt rows to be its own; checked on every row once, kept for every candidate.
            x64 -= max_logit
            x64 -= log_norm
            self.rebuildable = torch.equal(x64, lp)
        self._parts.setdefault("max", []).append(max_logit)
        self._parts.setdefault("norm", []).append(log_norm)
        self._parts["conf"].append(top_lp[:, 0].exp().numpy())
        self._parts["top"].append(top_ids)

    def join(self, later: ReferenceRows) -> None:
        """Append what `add` noted in `later` (rows that follow this one's, not yet finished) to this one."""
        assert self._parts is not None and later._parts is not None
        for name, values in later._parts.items():
            self._parts.setdefault(name, []).extend(values)
        self.rebuildable = self.rebuildable and later.rebuildable

    def finish(self) -> None:
        """Join what `add` noted, once every row was added; the rows are then read-only."""
        assert self._parts is not None
        parts, self._parts = self._parts, None
        self.max_logit, self.log_norm = torch.cat(parts["max"]), torch.cat(parts["norm"])
        self.conf, self.top = np.concatenate(parts["conf"]), np.concatenate(parts["top"])
        for array in (self.conf, self.top):  # shared by every candidate's TokenDetail: nobody may edit them
            array.setflags(write=False)

    def log_softmax(self, x64: torch.Tensor, start: int) -> torch.Tensor:
        """The float64 log-softmax of reference rows `start …` from their logits in float64, `x64`, in
        place: bit for bit what `add` wrote."""
        if not self.rebuildable:
            return torch.log_softmax(x64, dim=-1)
        rows = slice(start, start + len(x64))
        x64 -= self.max_logit[rows]
        x64 -= self.log_norm[rows]
        return x64


def top_hits_recorded(
    top_ids: np.ndarray, top_logp: np.ndarray, block: torch.Tensor, top_ckpt: np.ndarray
) -> np.ndarray:
    """`token_ranks.top_k_hits_tied` against a recording: the reference's values are its recorded top-k
    log-probs, every other token below them (a tie reaching past the recorded top-k cannot be seen); its
    column 0 is the same-top event, the reference's most probable tokens those of its recorded top-k that tie
    with its first."""
    k = top_ckpt.shape[1]
    ref_rows = np.full(tuple(block.shape), -np.inf)
    np.put_along_axis(ref_rows, top_ids.astype(np.int64), top_logp.astype(np.float64), axis=1)
    return token_ranks.top_k_hits_tied(ref_rows, block.double().numpy(), top_ids[:, :k], top_ckpt)


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
        if k == 1 and detail.same_top is not None:
            hits = detail.same_top  # ties included: the same figure as `same_top_p`
        elif detail.top_hits is not None:
            hits = detail.top_hits[:, k - 1]
        else:
            hits = token_ranks.top_k_hits(detail.top_ref, detail.top_ckpt, k)
        agree = metrics.rate_with_stderr(hits)
        values[f"top{k}_agreement"] = agree.value
        values[f"top{k}_agreement_stderr"] = agree.stderr
        values[f"top{k}_agreement_stderr_window"] = metrics.clustered_stderr(hits, windows)
    dp = np.exp(-nll_ckpt) - np.exp(-nll_ref)
    values.update({f"delta_p_{name}": v for name, v in metrics.delta_p_percentiles(dp).items()})
    for bucket in metrics.confidence_buckets(kld, detail.ref_top_p):
        name = _bucket_name(bucket.lo, bucket.hi)
        values[f"{name}_share"] = bucket.share
        assert bucket.inside is not None
        values[f"{name}_share_stderr_window"] = metrics.clustered_stderr(bucket.inside, windows)
        if bucket.mean is not None:
            values[f"{name}_mean"] = bucket.mean.value
            values[f"{name}_mean_stderr"] = bucket.mean.stderr
            values[f"{name}_mean_stderr_window"] = metrics.clustered_stderr(
                kld[bucket.inside], windows[bucket.inside]
            )
            values[f"{name}_median"] = bucket.median
    return values


def floor_metrics(
    ref: Observation,
    floors: list[Observation],
    kld: np.ndarray,
    windows: np.ndarray,
    chunk_rows: int,
    margin: float,
    shared: SharedWork | None = None,
) -> tuple[dict[str, Any], np.ndarray]:
    """The noise floor and where the candidate stands against it (`against_floor`), as `ppl` reports it:
    `kld_floor` with the spread of its draws, `kld_floor_ratio`, the per-token excess over the floor, the
    KLD allowed ((1 + margin) × the floor's) and the per-token statistic the outcome is tested on, with its
    error and bounds, and `noise_floor`, the outcome. Also the floor's per-token KLD."""
    draws = [_floor_kld(ref, f, chunk_rows, shared) for f in floors]
    floor = claims.against_floor(kld, draws, windows, margin)
    return {
        "kld_floor": floor.mean.value,
        "kld_floor_stderr": floor.mean.stderr,
        "kld_floor_stderr_window": metrics.clustered_stderr(floor.kld, windows),
        "kld_floor_draws": floor.draws,
        "kld_floor_draw_spread": floor.draw_spread,
        "kld_floor_ratio": floor.ratio,
        "kld_above_floor": floor.excess.value,
        "kld_above_floor_stderr_window": floor.excess_stderr,
        **floor.metrics("kld", "noise_floor"),
    }, floor.kld


def kld_at_reference(ref: Observation, ckpt: Observation) -> np.ndarray:
    """KL(ref ‖ ckpt) per scored token from the reference's compact form and the other side's log-probs at
    the ids it kept (long windows: `compact_window_logits`): exact over the top-k, sampled beyond."""
    a, c = ref.arrays, ckpt.arrays
    if len(a["top_ids"]) != len(c["at_top"]):
        raise InputError(f"the sides hold {len(a['top_ids'])} and {len(c['at_top'])} scored tokens")
    return metrics.kl_divergence_top_k_tail(
        a["top_logp"], c["at_top"], a["tail_mass"], a["tail_logp"], c["at_tail"]
    )


def _one_floor_kld(ref: Observation, floor: Observation, chunk_rows: int) -> np.ndarray:
    if "at_top" in floor.arrays:  # long windows: the floor kept its log-probs at the reference's ids only
        return kld_at_reference(ref, floor)
    return kld_per_token(ref, floor, chunk_rows)[0]


def _floor_kld(
    ref: Observation, floor: Observation, chunk_rows: int, shared: SharedWork | None
) -> np.ndarray:
    """The floor's per-token KLD, kept in `shared` by the two observations' keys: it is the reference's
    alone, the same for every candidate `compare` runs against it."""
    if not (ref.key and floor.key) or shared is None:  # unkeyed observations (made by hand) are never kept
        return _one_floor_kld(ref, floor, chunk_rows)

    def make() -> np.ndarray:
        kld = _one_floor_kld(ref, floor, chunk_rows)
        kld.setflags(write=False)
        return kld

    return shared.get(("floor-kld", ref.key, floor.key, chunk_rows), make)


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
