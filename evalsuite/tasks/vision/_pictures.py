"""The pictures the vision task shows, drawn from the spec: shapes and text with Pillow, a bar chart with
matplotlib, all without anti-aliasing, so that both sides, and every run, see the same pixels."""

from __future__ import annotations

import io
from typing import Any

from pydantic import Field

from evalsuite.contract.spec import StrictModel

RGB = tuple[int, int, int]


class Square(StrictModel):
    left: int
    top: int
    size: int
    color: RGB


class Circle(StrictModel):
    center_x: int
    center_y: int
    radius: int
    color: RGB


class Text(StrictModel):
    """A line of text in Pillow's own font (Aileron Regular, shipped inside Pillow: the same glyphs on every
    machine) at a font size of `size` pixels, its top-left corner at (`left`, `top`)."""

    text: str = Field(min_length=1)
    left: int
    top: int
    size: int = Field(48, ge=8, le=512)
    color: RGB = (0, 0, 0)


class Bar(StrictModel):
    label: str = Field(min_length=1)
    value: float = Field(ge=0)


class BarChart(StrictModel):
    """A bar chart drawn by matplotlib over the whole picture: one bar per entry, left to right, each labelled
    below its bar, on a value axis from 0."""

    bars: list[Bar] = Field(min_length=2, max_length=12)
    title: str = ""
    color: RGB = (70, 110, 180)


class ImageSpec(StrictModel):
    """A picture: the chart if any, then the square, the circle and the `shapes` in order, then the text."""

    width: int = 448
    height: int = 448
    background: RGB = (255, 255, 255)
    square: Square | None = None
    circle: Circle | None = None
    shapes: list[Square | Circle] = Field(default_factory=list)  # more of them, e.g. to be counted
    text: list[Text] = Field(default_factory=list)
    chart: BarChart | None = None

    def written(self) -> str:
        """The text the picture shows, its lines joined by a space: what an OCR case reads."""
        return " ".join(t.text for t in self.text)


class MovingSquare(StrictModel):
    """A square crossing the frame in a straight line: its left edge goes from `left_first` in the first
    frame to `left_last` in the last, in equal steps."""

    top: int
    size: int
    color: RGB
    left_first: int
    left_last: int


class VideoSpec(StrictModel):
    frames: int = Field(6, ge=2, le=64)
    width: int = 448
    height: int = 448
    background: RGB = (255, 255, 255)
    square: MovingSquare


def draw(spec: ImageSpec) -> Any:
    """The test image, drawn from the spec (deterministic: no anti-aliasing)."""
    from PIL import Image, ImageDraw, ImageFont

    if spec.chart is not None:
        image = draw_chart(spec.chart, spec.width, spec.height, spec.background)
    else:
        image = Image.new("RGB", (spec.width, spec.height), spec.background)
    pen = ImageDraw.Draw(image)
    pen.fontmode = "1"  # glyphs without anti-aliasing: pixels do not depend on how the edges are blended
    shapes = [s for s in (spec.square, spec.circle) if s is not None] + spec.shapes
    for shape in shapes:
        if isinstance(shape, Square):
            left, top, size = shape.left, shape.top, shape.size
            pen.rectangle((left, top, left + size - 1, top + size - 1), fill=shape.color)
        else:
            x, y, r = shape.center_x, shape.center_y, shape.radius
            pen.ellipse((x - r, y - r, x + r, y + r), fill=shape.color)
    for line in spec.text:
        pen.text((line.left, line.top), line.text, fill=line.color, font=ImageFont.load_default(line.size))
    return image


def draw_chart(chart: BarChart, width: int, height: int, background: RGB) -> Any:
    """The bar chart as a Pillow image of `width` × `height` pixels, drawn by matplotlib's Agg renderer in
    matplotlib's default style (whatever a matplotlibrc says) with its own DejaVu Sans, unsmoothed."""
    import matplotlib.style
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from PIL import Image

    dpi = 100
    unsmoothed = {"text.antialiased": False, "patch.antialiased": False, "lines.antialiased": False}
    with matplotlib.style.context(["default", unsmoothed]):
        figure = Figure(figsize=(width / dpi, height / dpi), dpi=dpi, facecolor=_rgb01(background))
        canvas = FigureCanvasAgg(figure)
        axes = figure.add_subplot()
        axes.set_facecolor(_rgb01(background))
        labels = [b.label for b in chart.bars]
        axes.bar(labels, [b.value for b in chart.bars], color=_rgb01(chart.color), edgecolor="black")
        axes.tick_params(labelsize=14)
        if chart.title:
            axes.set_title(chart.title, fontsize=16)
        axes.spines[["top", "right"]].set_visible(False)
        figure.tight_layout()
        canvas.draw()
        pixels = canvas.buffer_rgba()
    return Image.frombuffer("RGBA", (width, height), bytes(pixels)).convert("RGB")


def _rgb01(color: RGB) -> tuple[float, float, float]:
    r, g, b = color
    return (r / 255, g / 255, b / 255)


def draw_frames(spec: VideoSpec) -> list[Any]:
    """The clip's frames, drawn with Pillow: the square one equal step further along in each."""
    from PIL import Image, ImageDraw

    frames = []
    s = spec.square
    for i in range(spec.frames):
        left = s.left_first + round(i * (s.left_last - s.left_first) / (spec.frames - 1))
        frame = Image.new("RGB", (spec.width, spec.height), spec.background)
        ImageDraw.Draw(frame).rectangle((left, s.top, left + s.size - 1, s.top + s.size - 1), fill=s.color)
        frames.append(frame)
    return frames


def contact_sheet(frames: list[Any], gap: int = 4) -> Any:
    """The frames side by side at half size, in order, on a grey strip: the clip at a glance."""
    from PIL import Image

    small = [
        f.resize((max(1, f.width // 2), max(1, f.height // 2)), Image.Resampling.NEAREST) for f in frames
    ]
    width = sum(f.width for f in small) + gap * (len(small) + 1)
    height = max(f.height for f in small) + 2 * gap
    sheet = Image.new("RGB", (width, height), (128, 128, 128))
    x = gap
    for f in small:
        sheet.paste(f, (x, gap))
        x += f.width + gap
    return sheet


def png(image: Any) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()
