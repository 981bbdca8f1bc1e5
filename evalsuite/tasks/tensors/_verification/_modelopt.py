"""A ModelOpt candidate verified: each quantized Linear's weight and scales checked against its source
weight's shape and the claimed algorithm, decoded block by block of rows (`evalsuite.formats.modelopt`) and
measured against the source; then the config's claims (algorithm, modules left in float,
hf_quant_config.json beside config.json) against what the files hold.

ModelOpt installs only beside its own pins, so `decode_exact` stays unmeasured in a run; the slow tier checks
the decode bit for bit against ModelOpt's own dequantization, written beside its packs."""

from __future__ import annotations

from typing import Any

import numpy as np

from evalsuite.files.checkpoint import TensorInfo
from evalsuite.formats import ShardReader, as_float32, row_blocks
from evalsuite.formats.modelopt import (
    NVFP4_BLOCK,
    ModeloptFormat,
    decode_fp8,
    decode_nvfp4,
    layout_problems,
)
from evalsuite.tasks.tensors._verification._one_by_one import OneByOneVerifier
from evalsuite.tasks.tensors._verification._rows import ErrorAccumulator, Problem, TensorRow

__all__ = ["ModeloptFormat", "ModeloptVerifier"]

# The parts of a module that hold its weight (the input scale is the activations').
WEIGHT_PARTS = ("weight", "weight_scale", "weight_scale_2")


class ModeloptVerifier(OneByOneVerifier):
    """How a ModelOpt candidate is verified (see `FormatVerifier`)."""

    format: ModeloptFormat

    def measure(
        self, source: TensorInfo, tensors: dict[str, TensorInfo], reader: ShardReader, row: TensorRow
    ) -> list[Problem]:
        """Bits from the stored weight and its scales; the stored tensors against the source's shape; the
        decoded weight against the source weight."""
        fmt = self.format
        row.format = f"modelopt-{fmt.algo.lower()}"
        row.strategy = "tensor" if fmt.algo == "FP8" else "tensor_group"
        row.note = f"ModelOpt {fmt.algo}: decoded by evalsuite from ModelOpt's definition (no library here)"
        found = (
            [f"a weight_scale for a {len(source.shape)}-D source tensor"] if len(source.shape) != 2 else []
        )
        found = found or layout_problems(fmt, tuple(source.shape), tensors)
        if found:
            row.note = (
                f"not decoded: its stored tensors do not form a ModelOpt {fmt.algo} Linear of its shape"
            )
            return [Problem("config", source.name, p) for p in found]
        out_features, in_features = source.shape
        row.bits = fmt.bits
        stored = sum(tensors[p].nbytes for p in WEIGHT_PARTS if p in tensors)
        row.bits_per_weight = stored * 8 / (out_features * in_features)
        weight, scale = tensors["weight"], reader.tensor(tensors["weight_scale"])
        scale_2 = (
            float(reader.tensor(tensors["weight_scale_2"]).reshape(-1)[0]) if fmt.algo == "NVFP4" else 0.0
        )
        errors = ErrorAccumulator()
        for r0, r1 in row_blocks(out_features, in_features):
            codes = reader.rows(weight, r0, r1, "weight")
            if fmt.algo == "FP8":
                ours = decode_fp8(codes, float(scale.reshape(-1)[0]))
            else:
                ours = decode_nvfp4(codes, scale[r0:r1], scale_2)
            ref = as_float32(reader.rows(source, r0, r1, "source"), source.dtype)
            errors.add(r0, ref, ours, np.empty_like(ours))
        errors.fill(row)
        return []

    def check_config(self, rows: list[TensorRow]) -> tuple[list[Problem], dict[str, Any]]:
        """The claimed algorithm's bits against every quantized row's; a module the config leaves in float
        stored quantized; hf_quant_config.json against config.json; the claims themselves."""
        fmt = self.format
        problems = [
            Problem("config", row.name, f"{row.bits} bits stored, the config says {fmt.algo}")
            for row in rows
            if row.format == f"modelopt-{fmt.algo.lower()}" and row.bits is not None and row.bits != fmt.bits
        ]
        ignored = set(fmt.ignore)
        problems += [
            Problem("config", row.name, "stored quantized, but the config's ignore leaves it in float")
            for row in rows
            if row.format is not None
            and row.format.startswith("modelopt")
            and row.name.removesuffix(".weight") in ignored
        ]
        beside = fmt.beside
        if beside and beside.get("quant_algo") != fmt.algo:
            problems.append(
                Problem(
                    "config",
                    "hf_quant_config.json",
                    f"quant_algo {beside.get('quant_algo')!r}, config.json says {fmt.algo!r}",
                )
            )
        if beside and fmt.algo == "NVFP4" and beside.get("group_size", NVFP4_BLOCK) != NVFP4_BLOCK:
            problems.append(
                Problem("config", "hf_quant_config.json", f"group_size {beside.get('group_size')}, not 16")
            )
        claims = {"quant_algo": fmt.algo, "ignore": fmt.ignore}
        producer = fmt.config.get("producer")
        if isinstance(producer, dict):
            claims["producer"] = f"{producer.get('name')} {producer.get('version')}"
        return problems, claims
