"""An MLX candidate verified (mlx-lm's layout, `evalsuite.formats.mlx`): each quantized module's packed
weight, scales and biases checked against its source weight's shape and the config's group size and bits,
decoded block by block of rows, every row decoded a second time by MLX's own `mx.dequantize` (where `mlx` is
installed) to agree bit for bit, and measured against the source; then the config's claims."""

from __future__ import annotations

from typing import Any

import numpy as np

from evalsuite.files.checkpoint import TensorInfo
from evalsuite.formats import ShardReader, as_float32, row_blocks
from evalsuite.formats.ct_decode import first_difference
from evalsuite.formats.mlx import BITS, SCALE_BYTES, MlxFormat, decode, layout_problems, library_decode
from evalsuite.tasks.tensors._verification._one_by_one import OneByOneVerifier
from evalsuite.tasks.tensors._verification._rows import ErrorAccumulator, Problem, TensorRow


class MlxVerifier(OneByOneVerifier):
    """How an MLX candidate is verified (see `FormatVerifier`)."""

    format: MlxFormat
    # MLX's scheduler does not survive a fork: a child forked from a process that has run MLX (a caller that
    # quantized with it) hangs at its first MLX call, so the engine measures MLX packs in threads.
    threads_only = True

    def measure(
        self, source: TensorInfo, tensors: dict[str, TensorInfo], reader: ShardReader, row: TensorRow
    ) -> list[Problem]:
        """The module's scheme from the config; the stored tensors against the source's shape; the decoded
        weight against MLX's decode and against the source weight."""
        row.format, row.strategy = "mlx", "group"
        module = source.name.removesuffix(".weight")
        scheme = self.format.scheme(module)
        weight, scales, biases = tensors.get("weight"), tensors.get("scales"), tensors.get("biases")
        if scheme is None:
            return [Problem("config", source.name, "quantized, but config.json's `quantization` says false")]
        group, bits = scheme
        found = (
            layout_problems(tuple(source.shape), weight, scales, biases, group, bits)
            if len(source.shape) == 2
            else [f"scales for a {len(source.shape)}-D source tensor"]
        )
        if found or weight is None or scales is None or biases is None:
            row.note = (
                "not decoded: its stored tensors do not form an MLX-quantized weight of the source's shape"
            )
            return [Problem("config", source.name, p) for p in found]
        out_features, in_features = source.shape
        row.group = str(group)
        row.bits = bits
        row.bits_per_weight = bits + 8 * (SCALE_BYTES[scales.dtype] + SCALE_BYTES[biases.dtype]) / group
        errors, mismatch, checked = ErrorAccumulator(), None, 0
        for r0, r1 in row_blocks(out_features, in_features):
            packed = reader.rows(weight, r0, r1, "weight").view(np.uint32).reshape(r1 - r0, -1)
            s = as_float32(reader.rows(scales, r0, r1, "scales"), scales.dtype)
            b = as_float32(reader.rows(biases, r0, r1, "biases"), biases.dtype)
            ours = decode(packed, s, b, scales.dtype, group, bits)
            theirs = library_decode(packed, s, b, scales.dtype, group, bits)
            if theirs is not None:
                checked += r1 - r0
                at = first_difference(ours, theirs) if mismatch is None else None
                if at is not None:
                    mismatch = (
                        f"MLX and evalsuite decode element [{r0 + at[0]}, {at[1]}] differently: "
                        f"{theirs[at]:.6g} vs {ours[at]:.6g}"
                    )
            ref = as_float32(reader.rows(source, r0, r1, "source"), source.dtype)
            errors.add(r0, ref, ours, np.empty_like(ours))
        row.decode_exact = mismatch is None if checked else None
        row.library_checked_rows = checked
        errors.fill(row)
        return [Problem("decode", source.name, mismatch)] if mismatch else []

    def check_config(self, rows: list[TensorRow]) -> tuple[list[Problem], dict[str, Any]]:
        """The default scheme and the modules that override it."""
        problems = []
        if self.format.bits not in BITS:
            problems.append(
                Problem("config", "config.json", f"quantization.bits {self.format.bits} is not one of {BITS}")
            )
        # `code_bits`, not `bits`: the engine reads `bits` as bits per weight, which MLX does not claim (its
        # scales and biases add 8 · (their bytes) / group_size to the code width).
        claims = {"group_size": self.format.group_size, "code_bits": self.format.bits}
        if self.format.overrides:
            claims["overrides"] = len(self.format.overrides)
        return problems, claims
