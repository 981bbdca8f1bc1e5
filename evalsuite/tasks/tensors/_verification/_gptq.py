"""A GPTQ or AWQ candidate verified: each quantized Linear's qweight, qzeros, scales and g_idx checked against
its source weight's shape, its weight decoded (`evalsuite.formats.gptq`) and measured against the source;
then the config's claims (bits, group size, symmetry, activation order) against what the files hold.

No decoder of these formats imports beside evalsuite (GPTQModel and AutoAWQ build CUDA extensions), so
`decode_exact` stays unmeasured in a run; the slow tier checks the decode bit for bit against the writer's
own dequantization (auto-round's), written beside its packs."""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from evalsuite.files.checkpoint import TensorInfo
from evalsuite.formats import ShardReader, as_float32
from evalsuite.formats.gptq import GptqFormat, decode, layout_problems, unpack_words
from evalsuite.tasks.tensors._verification._one_by_one import OneByOneVerifier
from evalsuite.tasks.tensors._verification._rows import ErrorAccumulator, Problem, TensorRow


class GptqVerifier(OneByOneVerifier):
    """How a GPTQ or AWQ candidate is verified (see `FormatVerifier`)."""

    # auto-round saves the tensors it leaves unquantized (embedding, head, norms) in float32 from a BF16
    # source: protected, and value-equal to the source (every bf16 value is a float32).
    protected_casts: ClassVar[dict[tuple[str, str], str]] = {
        ("BF16", "F32"): "stored float32 as auto-round saves what it leaves unquantized: value-equal to the "
        "source widened to float32",
    }

    format: GptqFormat

    def measure(
        self, source: TensorInfo, tensors: dict[str, TensorInfo], reader: ShardReader, row: TensorRow
    ) -> list[Problem]:
        """Bits from qweight's size; the stored tensors against the source's shape; the decoded weight
        against the source weight (the whole tensor at once: a GPTQ weight packs down its inputs, so no
        block of output rows can be read alone)."""
        fmt = self.format
        row.format, row.decode_exact = fmt.method, None
        row.note = f"{fmt.method}: decoded by evalsuite from the writers' packing code (no library here)"
        problems = self._layout_problems(source, tensors)
        if problems:
            row.note = (
                f"not decoded: its stored tensors do not form a {fmt.method} Linear of the source's shape"
            )
            return [Problem("config", source.name, p) for p in problems]
        out_features, in_features = source.shape
        row.bits = row.bits_per_weight = tensors["qweight"].nbytes * 8 / (out_features * in_features)
        row.strategy = "group" if fmt.group_size > 0 else "channel"
        g_info = tensors.get("g_idx")
        g_idx = reader.tensor(g_info).astype(np.int64).reshape(-1) if g_info is not None else None
        qzeros = reader.tensor(tensors["qzeros"])
        decoded = decode(
            fmt, reader.tensor(tensors["qweight"]), qzeros, reader.tensor(tensors["scales"]), g_idx
        )
        ref = as_float32(reader.rows(source, 0, out_features, "source"), source.dtype)
        errors = ErrorAccumulator()
        errors.add(0, ref, decoded, np.empty_like(decoded))
        errors.fill(row)
        found: list[Problem] = []
        if g_idx is not None and not fmt.desc_act:
            consecutive = np.arange(in_features) // (fmt.group_size if fmt.group_size > 0 else in_features)
            if not np.array_equal(g_idx, consecutive):
                found.append(Problem("config", source.name, "g_idx scatters groups but desc_act is false"))
        if fmt.symmetric:
            zeros = unpack_words(qzeros, fmt.bits, axis=1) + fmt.zero_offset
            if (zeros != 1 << (fmt.bits - 1)).any():
                found.append(
                    Problem("config", source.name, f"zero points other than {1 << (fmt.bits - 1)} but sym")
                )
        return found

    def _layout_problems(self, source: TensorInfo, tensors: dict[str, TensorInfo]) -> list[str]:
        if len(source.shape) != 2:
            return [f"a qweight for a {len(source.shape)}-D source tensor"]
        return layout_problems(self.format, tuple(source.shape), tensors)

    def check_config(self, rows: list[TensorRow]) -> tuple[list[Problem], dict[str, Any]]:
        """The claimed bits against every quantized row's; the claims themselves."""
        fmt = self.format
        problems = [
            Problem("config", row.name, f"{row.bits:g} bits per weight stored, the config says {fmt.bits}")
            for row in rows
            if row.format == fmt.method and row.bits is not None and row.bits != fmt.bits
        ]
        claims = {
            k: fmt.config[k] for k in ("bits", "group_size", "sym", "desc_act", "version") if k in fmt.config
        }
        return problems, claims
