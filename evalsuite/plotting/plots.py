"""PNG plots for report.md, drawn with matplotlib's Agg backend (no display needed).

Each function takes arrays and a path and writes one figure atomically; none keeps state between calls. Each
is drawn in the command's plot process where it started one (`evalsuite.plotting.plot_process`).
"""

from __future__ import annotations

import io
import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from evalsuite.files.run_folder import write_atomic
from evalsuite.plotting.plot_process import drawn_here_or_there


def _figure(width: float = 6.4, height: float = 3.6, margins: dict[str, float] | None = None):
    """A figure laid out by constrained layout, or with fixed `margins` (subplots_adjust's, as fractions of
    the figure): the plots `ppl` draws for every candidate `compare` runs have a known layout, and
    constrained layout measures every tick label to find it, two thirds of such a plot's time."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    from matplotlib.figure import Figure

    # A bare Figure: no pyplot global state, so plots from concurrent runs never mix.
    if margins is None:
        return Figure(figsize=(width, height), dpi=100, layout="constrained")
    fig = Figure(figsize=(width, height), dpi=100)
    fig.subplots_adjust(**margins)
    return fig


# matplotlib writes the exponent with `%d`: an ASCII hyphen-minus, never U+2212.
_SUPERSCRIPT = str.maketrans("-0123456789", "⁻⁰¹²³⁴⁵⁶⁷⁸⁹")
_MATHTEXT_POWER = re.compile(r"^\$\\mathdefault\{(?:(\d+(?:\.\d+)?)\\times)?10\^\{(-?\d+)\}\}\$$")


def _plain_log_ticks(axis) -> None:
    """A log axis labelled as matplotlib labels it, its 10^n set in Unicode superscripts instead of mathtext,
    with minor ticks at 2 and 5 of each decade instead of every digit: mathtext's parser and the minor
    ticks were most of a log-scaled plot's drawing, which `ppl` pays for every candidate `compare` runs."""
    from matplotlib.ticker import LogFormatterSciNotation, LogLocator

    class PlainPowers(LogFormatterSciNotation):
        def __call__(self, x, pos=None):
            text = super().__call__(x, pos)
            match = _MATHTEXT_POWER.match(text)
            if match is None:
                return text  # anything else stays as matplotlib writes it
            mantissa, power = match.groups()
            return f"{mantissa + '×' if mantissa else ''}10{power.translate(_SUPERSCRIPT)}"

    axis.set_minor_locator(LogLocator(subs=(2.0, 5.0)))
    axis.set_major_formatter(PlainPowers())
    axis.set_minor_formatter(PlainPowers(labelOnlyBase=False, minor_thresholds=(2, 0.5)))


def _save(fig, path: Path) -> None:
    buf = io.BytesIO()
    # No timestamps or software tags in the PNG: the same data gives the same bytes.
    fig.savefig(buf, format="png", metadata={"Software": None})
    write_atomic(path, buf.getvalue())


@drawn_here_or_there
def kld_histogram(kld: np.ndarray, path: Path, estimator: str, title: str = "KL(ref ‖ ckpt)") -> None:
    """Histogram of per-token KL divergence on a log-spaced axis, with the mean and the p99 marked; `title`
    names the divergence plotted (which distribution from which)."""
    fig = _figure(margins={"left": 0.1, "right": 0.97, "bottom": 0.14, "top": 0.91})
    ax = fig.add_subplot()
    values = np.asarray(kld, dtype=np.float64)
    positive = values[values > 0]
    if positive.size:
        lo, hi = positive.min(), positive.max()
        bins = np.geomspace(lo, hi if hi > lo else lo * 10, 60)
        counts, _ = np.histogram(positive, bins=bins)
        # One step patch, not `hist`'s 59 rectangles: the same bars, drawn and laid out as one artist (the
        # figure is drawn for every candidate `compare` runs).
        ax.stairs(counts, bins, fill=True, facecolor="#4c72b0", edgecolor="none")
        ax.set_xscale("log")
        _plain_log_ticks(ax.xaxis)
        for q, label, style in ((values.mean(), "mean", "-"), (np.quantile(values, 0.99), "p99", "--")):
            if q > 0:
                ax.axvline(q, color="#c44e52", linestyle=style, label=f"{label} {q:.3g}")
        ax.legend()
    else:
        ax.text(0.5, 0.5, "KLD is 0 at every token", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel(f"KL divergence per token (nats, {estimator})")
    ax.set_ylabel("tokens")
    ax.set_title(f"Per-token {title} ({values.size} tokens)")
    _save(fig, path)


@drawn_here_or_there
def window_ppl(
    ppl_ref: Sequence[float], ppl_ckpt: Sequence[float], starts: Sequence[int], path: Path
) -> None:
    """Per-window perplexity of both sides, side by side."""
    fig = _figure(margins={"left": 0.1, "right": 0.97, "bottom": 0.25, "top": 0.91})
    ax = fig.add_subplot()
    x = np.arange(len(starts))
    ax.bar(x - 0.2, ppl_ref, width=0.4, label="ref", color="#4c72b0")
    ax.bar(x + 0.2, ppl_ckpt, width=0.4, label="ckpt", color="#dd8452")
    ax.set_xticks(x, [str(s) for s in starts], rotation=45)
    ax.set_xlabel("window start (token)")
    ax.set_ylabel("perplexity")
    ax.set_title("Perplexity per window")
    ax.legend(loc="lower right", framealpha=0.9)
    _save(fig, path)


@drawn_here_or_there
def relative_error_by_layer(
    layers: Sequence[int | None], projections: Sequence[str], rel_err: Sequence[float], path: Path
) -> None:
    """Relative error of each quantized tensor as a map of projection × layer.

    One cell per (projection, layer), holding the worst tensor of the cell (the experts of a layer share one);
    tensors outside the layer stacks (the head) go in a last column, "—". The colour scale is logarithmic.
    """
    from matplotlib.colors import LogNorm

    names = sorted(set(projections))
    numbered = sorted({layer for layer in layers if layer is not None})
    columns = [str(layer) for layer in numbered] + (["—"] if any(layer is None for layer in layers) else [])
    column_of = {layer: i for i, layer in enumerate(numbered)}
    grid = np.full((len(names), len(columns)), np.nan)
    for layer, projection, err in zip(layers, projections, rel_err, strict=True):
        i, j = names.index(projection), column_of.get(layer, len(numbered))
        grid[i, j] = err if np.isnan(grid[i, j]) else max(grid[i, j], err)
    fig = _figure(
        width=min(16.0, max(6.4, 2.5 + 0.25 * len(columns))), height=min(12.0, 1.6 + 0.3 * len(names))
    )
    ax = fig.add_subplot()
    finite = grid[np.isfinite(grid)]
    if finite.size:
        positive = finite[finite > 0]
        norm = LogNorm(positive.min(), max(positive.max(), positive.min() * 1.01)) if positive.size else None
        image = ax.imshow(np.ma.masked_invalid(grid), aspect="auto", cmap="viridis", norm=norm)
        bar = fig.colorbar(image, ax=ax, label="‖Ŵ − W‖ / ‖W‖")
        # A log scale's minor ticks are a dozen more tick artists, each laid out twice (constrained layout,
        # then the render): a third of the figure's 0.45 s, where the task's own work is a few seconds.
        bar.minorticks_off()
        step = max(1, len(columns) // 40)
        ax.set_xticks(range(0, len(columns), step), columns[::step])
        ax.set_yticks(range(len(names)), names, fontsize=8 if len(names) > 12 else 10)
    else:
        ax.text(0.5, 0.5, "no decoded tensor", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("layer")
    experts = " (of a layer's experts, the worst)" if any("*" in name for name in names) else ""
    ax.set_title(f"Relative error per layer and projection ({len(rel_err):,} tensors){experts}")
    _save(fig, path)


@drawn_here_or_there
def layer_errors(
    own: Sequence[float], drift: Sequence[float], path: Path, kinds: Sequence[str] | None = None
) -> None:
    """Relative error of the hidden states per decoder layer: each layer's own (fed the reference's input)
    and the drift accumulated on the candidate's own prefix, on a log axis (exact zeros are left out). In a
    hybrid model (`kinds`, one per layer, of more than one kind) the layers of the rarer kinds are shaded:
    Qwen3.5's full-attention layers, one in four, among its Gated DeltaNet layers."""
    fig = _figure(width=min(16.0, max(6.4, 2.0 + 0.2 * len(own))))
    ax = fig.add_subplot()
    x = np.arange(len(own))
    if kinds is not None and len(set(kinds)) > 1:
        common = max(sorted(set(kinds)), key=list(kinds).count)
        shades = dict(zip(sorted(set(kinds) - {common}), ("#dddddd", "#c6dbef", "#fdd0a2"), strict=False))
        for kind, colour in shades.items():
            for i in (i for i, k in enumerate(kinds) if k == kind):
                ax.axvspan(
                    i - 0.5,
                    i + 0.5,
                    color=colour,
                    linewidth=0,
                    label=kind if i == list(kinds).index(kind) else None,
                )
    for values, label, style in ((drift, "drift (own prefix)", "-o"), (own, "own (reference input)", "-s")):
        y = np.asarray(values, dtype=np.float64)
        shown = np.where(y > 0, y, np.nan)
        ax.plot(x, shown, style, markersize=3, label=label)
    if (np.asarray([*own, *drift], dtype=np.float64) > 0).any():
        ax.set_yscale("log")
        ax.legend()
    else:
        ax.text(0.5, 0.5, "every layer matches exactly", ha="center", va="center", transform=ax.transAxes)
    step = max(1, len(own) // 40)
    ax.set_xticks(x[::step], [str(i) for i in x[::step]])
    ax.set_xlabel("decoder layer")
    ax.set_ylabel("‖h_ckpt − h_ref‖ / ‖h_ref‖")
    ax.set_title(f"Hidden-state error per decoder layer ({len(own)} layers)")
    _save(fig, path)


@drawn_here_or_there
def unit_bars(names: Sequence[str], kld: Sequence[float], path: Path, whole: float) -> None:
    """Mean KL divergence of the reference with one unit swapped for the candidate's, largest first, with
    the whole candidate's KLD marked."""
    order = np.argsort(-np.asarray(kld, dtype=np.float64), kind="stable")
    shown = order[:40]
    fig = _figure(height=min(12.0, 1.6 + 0.22 * len(shown)))
    ax = fig.add_subplot()
    y = np.arange(len(shown))
    ax.barh(y, [kld[i] for i in shown], color="#4c72b0")
    ax.set_yticks(y, [names[i] for i in shown], fontsize=8 if len(shown) > 12 else 10)
    ax.invert_yaxis()
    ax.axvline(whole, color="#c44e52", linestyle="--", label=f"whole candidate {whole:.3g}")
    ax.legend(loc="lower right")
    ax.set_xlabel("mean KL(ref ‖ ref with this unit swapped) per token (nats)")
    more = f" (largest {len(shown)} of {len(names)})" if len(names) > len(shown) else ""
    ax.set_title(f"KL attribution by unit{more}")
    _save(fig, path)


@drawn_here_or_there
def kld_by_position(
    positions: np.ndarray, kld: np.ndarray, edges: Sequence[int], path: Path, estimator: str
) -> None:
    """Mean KL divergence against the position in the window (means of bins of about 1/64 of the scored
    span, a log axis), with the position buckets' edges marked: drift with depth shows as a rising line."""
    fig = _figure()
    ax = fig.add_subplot()
    pos = np.asarray(positions, dtype=np.int64)
    values = np.asarray(kld, dtype=np.float64)
    lo, hi = int(pos.min()), int(pos.max()) + 1
    bins = np.unique(np.linspace(lo, hi, min(65, hi - lo + 1)).astype(np.int64))
    which = np.clip(np.searchsorted(bins, pos, side="right") - 1, 0, len(bins) - 2)
    counts = np.bincount(which, minlength=len(bins) - 1)
    sums = np.bincount(which, weights=values, minlength=len(bins) - 1)
    means = np.where(counts > 0, sums / np.maximum(counts, 1), np.nan)
    centres = (bins[:-1] + bins[1:]) / 2
    if (means > 0).any():
        ax.plot(centres, np.where(means > 0, means, np.nan), "-o", markersize=3, color="#4c72b0")
        ax.set_yscale("log")
    else:
        ax.text(0.5, 0.5, "KLD is 0 at every position", ha="center", va="center", transform=ax.transAxes)
    for edge in edges:
        if lo < edge < hi:
            ax.axvline(edge, color="#c44e52", linestyle="--", linewidth=0.8)
    ax.set_xlabel("position in the window of the logits (they predict the next token)")
    ax.set_ylabel(f"mean KLD per token (nats, {estimator})")
    ax.set_title(f"KL(ref ‖ ckpt) by position ({values.size} tokens)")
    _save(fig, path)


@drawn_here_or_there
def metric_vs_bpw(
    names: Sequence[str],
    bpw: Sequence[float],
    values: Sequence[float],
    errors: Sequence[float],
    front: Sequence[bool],
    path: Path,
    ylabel: str,
    floor: float | None = None,
) -> None:
    """One point per candidate against its bits per weight, with error bars; the Pareto front joined by a
    line, and the noise floor drawn where one was measured."""
    fig = _figure()
    ax = fig.add_subplot()
    x, y = np.asarray(bpw, dtype=np.float64), np.asarray(values, dtype=np.float64)
    ax.errorbar(x, y, yerr=np.asarray(errors, dtype=np.float64), fmt="o", capsize=3, color="tab:blue")
    on = np.asarray(front, dtype=bool)
    if on.any():
        order = np.argsort(x[on])
        ax.plot(x[on][order], y[on][order], "-", color="tab:blue", alpha=0.5, label="Pareto front")
    for name, xi, yi in zip(names, x, y, strict=True):
        ax.annotate(name, (xi, yi), textcoords="offset points", xytext=(4, 4), fontsize=7)
    if floor is not None:
        ax.axhline(floor, color="tab:gray", linestyle="--", label=f"noise floor {floor:.3g}")
    ax.set_xlabel("bits per weight")
    ax.set_ylabel(ylabel)
    if on.any() or floor is not None:
        ax.legend(fontsize=8)
    _save(fig, path)


def _label_step(n: int, height_inches: float, fontsize: float) -> int:
    """Every how many rows a tick label goes so that labels of `fontsize` points do not overlap in an axis
    `height_inches` tall (a label needs about 1.4 × its size in height)."""
    fits = max(1, int(height_inches * 72 / (1.4 * fontsize)))
    return max(1, -(-n // fits))


@drawn_here_or_there
def expert_heatmap(
    rel_err: np.ndarray, layers: Sequence[int], path: Path, hurt_floor: float | None = None
) -> None:
    """Relative output error of every routed expert, MoE layer × expert, on a log colour scale, in two panels:
    by expert index (where is the damage), and each layer's experts sorted worst first (how much of each
    layer is damaged: at 256 experts a layer's few bad experts are single pixels in the first). Experts the
    reference never routes to (NaN) are blank (last, in the sorted panel); exact zeros are shown at the
    scale's floor. `hurt_floor`, where given, is marked on the colour bar. The figure's size is capped, one
    cell per pixel column at most, and no cell is labelled, so 40 layers × 256 experts stay legible."""
    from matplotlib.colors import LogNorm

    values = np.asarray(rel_err, dtype=np.float64)
    n_layers, n_experts = values.shape
    positive = values[np.isfinite(values) & (values > 0)]
    panel = min(5.5, 0.9 + 0.12 * n_layers)  # inches per panel: 40 layers fit at about 12 pixels a row
    fig = _figure(width=min(16.0, max(6.4, 2.5 + 0.05 * n_experts)), height=1.2 + 2 * panel)
    axes = fig.subplots(2, 1, sharey=True)
    # Descending with the unused (NaN) last: np.sort puts NaN last, so sort the negated values.
    ranked = -np.sort(-values, axis=1)
    norm = None
    if positive.size:
        floor = float(positive.min())
        norm = LogNorm(floor, max(float(positive.max()), floor * 1.0001))
    fontsize = 8 if n_layers > 16 else 10
    step = _label_step(n_layers, panel - 0.6, fontsize)
    image = None
    for ax, grid, xlabel in (
        (axes[0], values, "routed expert"),
        (axes[1], ranked, "rank within its layer (worst first)"),
    ):
        if norm is not None:
            shown = np.where(np.isfinite(grid), np.maximum(grid, norm.vmin), np.nan)
            image = ax.imshow(shown, aspect="auto", interpolation="nearest", norm=norm)
        else:
            ax.imshow(np.where(np.isfinite(grid), 0.0, np.nan), aspect="auto", interpolation="nearest")
            ax.text(
                0.5,
                0.5,
                "every used expert matches exactly",
                ha="center",
                va="center",
                transform=ax.transAxes,
            )
        ax.set_yticks(range(0, n_layers, step), [str(layer) for layer in layers[::step]], fontsize=fontsize)
        ax.set_xticks(range(0, n_experts, max(1, -(-n_experts // 32))))
        ax.tick_params(axis="x", labelsize=fontsize)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("decoder layer")
    if image is not None:
        marked = hurt_floor is not None and norm is not None and norm.vmin <= hurt_floor <= norm.vmax
        label = "‖y_ckpt − y_ref‖ / ‖y_ref‖" + (" (red: the hurt floor)" if marked else "")
        bar = fig.colorbar(image, ax=list(axes), label=label, shrink=0.8)
        _plain_log_ticks(
            bar.ax.yaxis
        )  # labels at 2 and 5 of a decade: expert errors often span less than one
        if marked:
            bar.ax.axhline(hurt_floor, color="#c44e52", linewidth=2)
    used = int(np.isfinite(values).sum())
    fig.suptitle(f"Routed-expert output error: {n_layers} MoE layers × {n_experts} experts ({used} used)")
    _save(fig, path)
