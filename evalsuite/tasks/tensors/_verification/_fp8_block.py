"""A block-wise FP8 candidate verified: each quantized Linear's FP8 weight and `weight_scale_inv` checked
against its source weight's shape and the config's block size, decoded block by block of rows
(`evalsuite.formats.fp8_block`), every row decoded a second time by Transformers' own dequantization to agree
bit for bit, and measured against the source; then the config's claims against what the files hold."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from evalsuite.files.checkpoint import TensorInfo
from evalsuite.formats import ShardReader, as_float32, row_blocks
from evalsuite.formats.ct_decode import first_difference
from evalsuite.formats.fp8_block import Fp8BlockFormat, decode, library_decode
from evalsuite.tasks.tensors._verification._one_by_one import OneByOneVerifier
from evalsuite.tasks.tensors._verification._rows import ErrorAccumulator, Problem, TensorRow


class Fp8BlockVerifier(OneByOneVerifier):
    """How a block-wise FP8 candidate is verified (see `FormatVerifier`)."""

    format: Fp8BlockFormat

    def before_fork(self) -> None:
        """Import Transformers' FP8 integration once, before workers fork."""
        import transformers.integrations.finegrained_fp8  # noqa: F401

    def measure(
        self, source: TensorInfo, tensors: dict[str, TensorInfo], reader: ShardReader, row: TensorRow
    ) -> list[Problem]:
        """Bits from the weight's dtype; the stored tensors against the source's shape and the block size;
        the decoded weight against Transformers' decode and against the source weight."""
        row.format, row.strategy = "fp8-block", "block"
        block = self.format.block
        weight, scale_info = tensors.get("weight"), tensors["weight_scale_inv"]
        found = _layout_problems(source, weight, scale_info, block)
        if found or weight is None or block is None:
            row.note = (
                "not decoded: its stored tensors do not form a block-wise FP8 Linear of the source's shape"
            )
            return [Problem("config", source.name, p) for p in found]
        out_features, in_features = source.shape
        row.bits = row.bits_per_weight = 8
        scale = reader.tensor(scale_info)
        errors, mismatch = ErrorAccumulator(), None
        for r0, r1 in row_blocks(out_features, in_features, block[0]):
            codes = reader.rows(weight, r0, r1, "weight")
            ours = decode(codes, scale, block, r0)
            factors = scale[r0 // block[0] : math.ceil(r1 / block[0])]
            try:
                theirs = library_decode(codes, factors)
            except ValueError as exc:  # Transformers refuses blocks the shape does not divide into
                row.note = f"Transformers cannot dequantize it: {exc}"
                theirs = None
            at = first_difference(ours, theirs) if mismatch is None and theirs is not None else None
            if at is not None:
                r, c = r0 + at[0], at[1]
                mismatch = (
                    f"Transformers and evalsuite decode element [{r}, {c}] differently: "
                    f"{theirs[at]:.6g} vs {ours[at]:.6g}"
                )
            ref = as_float32(reader.rows(source, r0, r1, "source"), source.dtype)
            errors.add(r0, ref, ours, np.empty_like(ours))
        row.decode_exact = mismatch is None if row.note is None else None
        row.library_checked_rows = out_features if row.decode_exact is not None else 0
        errors.fill(row)
        return [Problem("decode", source.name, mismatch)] if mismatch else []

    def check_config(self, rows: list[TensorRow]) -> tuple[list[Problem], dict[str, Any]]:
        """A block size is claimed (per-tensor FP8 is another layout); the claims themselves."""
        config = self.format.config
        problems = []
        if self.format.block is None:
            problems.append(Problem("config", "config.json", "quant_method fp8 without weight_block_size"))
        claims = {
            k: config[k] for k in ("weight_block_size", "activation_scheme", "scale_fmt") if k in config
        }
        return problems, claims


def _layout_problems(
    source: TensorInfo, weight: TensorInfo | None, scale: TensorInfo, block: tuple[int, int] | None
) -> list[str]:
    if len(source.shape) != 2:
        return [f"a weight_scale_inv for a {len(source.shape)}-D source tensor"]
    if weight is None:
        return ["a weight_scale_inv but no weight"]
    if block is None:
        return []  # check_config says it once
    out_features, in_features = source.shape
    found = []
    if weight.dtype != "F8_E4M3" or tuple(weight.shape) != (out_features, in_features):
        found.append(
            f"weight is {weight.dtype} {list(weight.shape)}, not F8_E4M3 {[out_features, in_features]}"
        )
    grid = (math.ceil(out_features / block[0]), math.ceil(in_features / block[1]))
    if scale.dtype != "F32" or tuple(scale.shape) != grid:
        found.append(
            f"weight_scale_inv is {scale.dtype} {list(scale.shape)}, not F32 {list(grid)} "
            f"(blocks of {block[0]}×{block[1]})"
        )
    return found
