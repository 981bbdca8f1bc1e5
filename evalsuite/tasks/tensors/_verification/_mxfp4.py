"""An MXFP4 candidate verified (gpt-oss's layout, `evalsuite.formats.mxfp4`): each fused experts parameter's
blocks and scales checked against the source parameter's shape, decoded expert by expert, every expert
decoded a second time by Transformers' own dequantization to agree bit for bit, and measured against the
source (a channel is one expert's output feature); then the config's claims."""

from __future__ import annotations

from typing import Any

import numpy as np

from evalsuite.files.checkpoint import TensorInfo
from evalsuite.formats import ShardReader, as_float32
from evalsuite.formats.ct_decode import first_difference
from evalsuite.formats.mxfp4 import BLOCK, Mxfp4Format, decode, library_decode

__all__ = ["Mxfp4Format", "Mxfp4Verifier"]
from evalsuite.tasks.tensors._verification._one_by_one import OneByOneVerifier
from evalsuite.tasks.tensors._verification._rows import ErrorAccumulator, Problem, TensorRow


class Mxfp4Verifier(OneByOneVerifier):
    """How an MXFP4 candidate is verified (see `FormatVerifier`)."""

    format: Mxfp4Format

    def before_fork(self) -> None:
        """Transformers' MXFP4 integration, imported once before workers fork."""
        import transformers.integrations.mxfp4  # noqa: F401

    def measure(
        self, source: TensorInfo, tensors: dict[str, TensorInfo], reader: ShardReader, row: TensorRow
    ) -> list[Problem]:
        """The stored blocks and scales against the source parameter's shape; each expert's decoded weight
        against Transformers' decode and against the source."""
        row.format, row.strategy = "mxfp4", "group"
        blocks, scales = tensors.get("blocks"), tensors["scales"]
        found = _layout_problems(source, blocks, scales)
        if found or blocks is None:
            row.note = "not decoded: its blocks and scales do not form MXFP4 experts of the source's shape"
            return [Problem("config", source.name, p) for p in found]
        experts, in_features, out_features = source.shape
        groups = in_features // BLOCK
        row.group, row.bits = str(BLOCK), 4
        row.bits_per_weight = 4 + 8 / BLOCK  # one E8M0 byte per block of 32
        errors, mismatch = ErrorAccumulator(), None
        for e in range(experts):
            codes = reader.rows(blocks, e * out_features * groups, (e + 1) * out_features * groups, "blocks")
            codes = codes.reshape(out_features, groups, 16)
            exps = reader.rows(scales, e * out_features, (e + 1) * out_features, "scales")
            ours = decode(codes, exps)
            theirs = library_decode(codes, exps)
            at = first_difference(ours, theirs) if mismatch is None else None
            if at is not None:
                mismatch = (
                    f"Transformers and evalsuite decode expert {e}'s element [{at[0]}, {at[1]}] differently: "
                    f"{theirs[at]:.6g} vs {ours[at]:.6g}"
                )
            ref = as_float32(
                reader.rows(source, e * in_features, (e + 1) * in_features, "source"), source.dtype
            )
            errors.add(e * out_features, np.ascontiguousarray(ref.T), ours, np.empty_like(ours))
        row.decode_exact = mismatch is None
        row.library_checked_rows = experts * out_features
        errors.fill(row)
        return [Problem("decode", source.name, mismatch)] if mismatch else []

    def check_config(self, rows: list[TensorRow]) -> tuple[list[Problem], dict[str, Any]]:
        """The claims: what the config leaves unconverted."""
        config = self.format.config
        claims = {k: config[k] for k in ("modules_to_not_convert",) if k in config}
        return [], claims


def _layout_problems(source: TensorInfo, blocks: TensorInfo | None, scales: TensorInfo) -> list[str]:
    if len(source.shape) != 3:
        return [f"MXFP4 scales for a {len(source.shape)}-D source tensor (fused experts are 3-D)"]
    if blocks is None:
        return ["scales without blocks beside them"]
    experts, in_features, out_features = source.shape
    if in_features % BLOCK:
        return [f"rows of {in_features} weights are no whole number of {BLOCK}-weight blocks"]
    groups = in_features // BLOCK
    found = []
    if blocks.dtype != "U8" or tuple(blocks.shape) != (experts, out_features, groups, 16):
        found.append(
            f"blocks are {blocks.dtype} {list(blocks.shape)}, not U8 {[experts, out_features, groups, 16]}"
        )
    if scales.dtype != "U8" or tuple(scales.shape) != (experts, out_features, groups):
        found.append(
            f"scales are {scales.dtype} {list(scales.shape)}, not U8 {[experts, out_features, groups]}"
        )
    return found
