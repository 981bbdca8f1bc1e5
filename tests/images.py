"""Images the tests feed to the tiny MiniCPM-V fixtures."""

from __future__ import annotations

from typing import Any


def tiny_test_image() -> Any:
    """A deterministic 200×300 RGB PIL image: large enough for the tiny processor to slice it (2×2 grid)."""
    import numpy as np
    from PIL import Image

    height, width = 300, 200
    y, x = np.mgrid[0:height, 0:width]
    pixels = np.stack([x * 255 // width, y * 255 // height, (x + y) % 256], axis=-1).astype("uint8")
    return Image.fromarray(pixels)  # (H, W, 3) uint8 is RGB
