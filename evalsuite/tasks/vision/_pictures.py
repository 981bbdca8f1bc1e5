"""The pictures the vision task shows, drawn with Pillow from the spec: deterministic (no anti-aliasing), so
that both sides, and every run, see the same pixels."""

from __future__ import annotations

import io
from typing import Any

from pydantic import Field

from evalsuite.spec import StrictModel

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


class ImageSpec(StrictModel):
    width: int = 448
    height: int = 448
    background: RGB = (255, 255, 255)
    square: Square
    circle: Circle


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
    """The test image, drawn with Pillow from the spec (deterministic: no anti-aliasing)."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (spec.width, spec.height), spec.background)
    pen = ImageDraw.Draw(image)
    s, c = spec.square, spec.circle
    pen.rectangle((s.left, s.top, s.left + s.size - 1, s.top + s.size - 1), fill=s.color)
    pen.ellipse(
        (c.center_x - c.radius, c.center_y - c.radius, c.center_x + c.radius, c.center_y + c.radius),
        fill=c.color,
    )
    return image


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
