"""The pictures of the shipped vision spec show what their questions ask about: the label its text, the chart
its bars in the order of their values, the counting picture five circles beside two squares; each drawn the
same every time, without anti-aliasing."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import ndimage

from evalsuite.contract.spec import default_spec_path, load_spec
from evalsuite.tasks.vision import VisionSpec
from evalsuite.tasks.vision._pictures import draw


@pytest.fixture(scope="module")
def images():
    return load_spec(VisionSpec, default_spec_path("vision")).images


def pixels(spec) -> np.ndarray:
    return np.asarray(draw(spec))


def test_the_label_is_its_text_in_black_on_white_and_nothing_else(images):
    label = images["label"]
    assert label.written() == "KAFKA 7351"
    drawn = pixels(label)
    colours = {tuple(c) for c in drawn.reshape(-1, 3)}
    assert colours == {(0, 0, 0), (255, 255, 255)}  # no blended edge: the same pixels on every machine
    rows, cols = np.nonzero((drawn == 0).all(-1))
    line = label.text[0]
    assert rows.min() >= line.top and rows.max() < line.top + line.size * 1.25
    assert cols.min() >= line.left and cols.max() < label.width
    # Ten characters, the space one gap: at least nine separate glyph columns runs.
    inked = (drawn == 0).all(-1).any(0)
    runs = np.count_nonzero(inked[1:] & ~inked[:-1])
    assert runs >= 9, runs
    assert np.array_equal(drawn, pixels(label))


def test_the_chart_stands_its_bars_in_the_order_of_their_values(images):
    chart = images["chart"]
    drawn = pixels(chart)
    colour = np.array(chart.chart.color)
    filled = (drawn == colour).all(-1)
    # Each bar a run of columns holding its colour; its height the most rows of its colour in one column.
    columns = filled.any(0)
    starts = np.flatnonzero(columns[1:] & ~columns[:-1]) + 1
    ends = np.flatnonzero(~columns[1:] & columns[:-1]) + 1
    heights = [int(filled[:, a:b].sum(0).max()) for a, b in zip(starts, ends, strict=True)]
    values = [b.value for b in chart.chart.bars]
    assert len(heights) == len(values) == 4
    assert np.argsort(heights).tolist() == np.argsort(values).tolist()
    assert chart.chart.bars[int(np.argmax(heights))].label == "plums"
    # In proportion to the values, but for the outline: each bar's black edge takes its pixels off the fill.
    assert heights[1] / heights[3] == pytest.approx(7 / 2, rel=0.05)
    assert np.array_equal(drawn, pixels(chart))


def test_the_counting_picture_shows_five_circles_and_two_squares(images):
    drawn = pixels(images["circles"])
    _, circles = ndimage.label((drawn == (30, 150, 60)).all(-1))
    _, squares = ndimage.label((drawn == (240, 140, 20)).all(-1))
    assert (circles, squares) == (5, 2)
