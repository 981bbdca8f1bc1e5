"""The plots' log axes: labelled as matplotlib labels them, powers of ten in Unicode superscripts (no
mathtext), and the same bytes for the same data."""

from __future__ import annotations

import numpy as np
from PIL import Image

from evalsuite.plotting import plots


def _labels(lo: float, hi: float) -> list[str]:
    fig = plots._figure(margins={"left": 0.1, "right": 0.97, "bottom": 0.14, "top": 0.91})
    ax = fig.add_subplot()
    ax.plot([lo, hi], [0, 1])
    ax.set_xscale("log")
    plots._plain_log_ticks(ax.xaxis)
    fig.canvas.draw()
    ticks = ax.xaxis.get_majorticklabels() + ax.xaxis.get_minorticklabels()
    return [t.get_text() for t in ticks if t.get_text()]


def test_decades_are_labelled_in_superscripts_without_mathtext():
    labels = _labels(1e-5, 3.0)
    assert {"10⁻⁵", "10⁻³", "10⁰"} <= set(labels)
    assert not any("$" in label for label in labels)


def test_a_range_within_one_decade_keeps_its_minor_labels():
    labels = _labels(1.6e-3, 4.2e-3)
    assert "2×10⁻³" in labels and not any("$" in label for label in labels)


def test_a_label_of_another_form_is_left_as_matplotlib_writes_it():
    assert plots._MATHTEXT_POWER.match(r"$\mathdefault{1}$") is None
    assert plots._MATHTEXT_POWER.match(r"$\mathdefault{2.5\times10^{-3}}$").groups() == ("2.5", "-3")


def test_the_kld_histogram_is_the_same_png_for_the_same_data(tmp_path):
    kld = np.exp(np.random.default_rng(0).normal(-5, 2, 2040))
    first, second = tmp_path / "a.png", tmp_path / "b.png"
    plots.kld_histogram(kld, first, "exact")
    plots.kld_histogram(kld, second, "exact")
    assert first.read_bytes() == second.read_bytes()
    assert Image.open(first).size == (640, 360)
