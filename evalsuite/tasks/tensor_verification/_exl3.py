"""An EXL3 candidate verified: each quantized Linear's trellis, sign vectors and codebook marker against its
source weight, then `tensor_storage` and the config's bit and codebook claims against what the files hold.
EXL3 weights are classified and checked here, not decoded."""

from __future__ import annotations

from typing import Any

import numpy as np

from evalsuite.checkpoint import EXL3_CONFIG_FILE, TensorInfo
from evalsuite.formats import ShardReader
from evalsuite.formats.exl3 import CODEBOOK_MULTIPLIERS, PART_CLAIMS, TORCH_DTYPE_NAMES, Exl3, bits_per_weight
from evalsuite.tasks.tensor_verification._rows import Problem, TensorRow


class Exl3Verifier:
    """How an EXL3 candidate is verified (see `FormatVerifier`)."""

    def __init__(self, format: Exl3) -> None:
        self.format = format

    def measure(
        self, source: TensorInfo, tensors: dict[str, TensorInfo], reader: ShardReader, row: TensorRow
    ) -> list[Problem]:
        """Bits from the trellis shape; the trellis, sign vectors and codebook marker against the source."""
        found: list[str] = []
        trellis = tensors["trellis"]
        row.format, row.codebook, row.note = "exl3", None, "no CPU decoder for EXL3 trellises"
        if len(source.shape) != 2:
            return [Problem("config", source.name, f"a trellis for a {len(source.shape)}-D source tensor")]
        out_features, in_features = source.shape
        if trellis.dtype != "I16" or len(trellis.shape) != 3:
            found.append(f"trellis is {trellis.dtype} {list(trellis.shape)}, not a 3-D I16 tensor")
        else:
            tiles = (in_features // 16, out_features // 16)
            if in_features % 16 or out_features % 16 or tuple(trellis.shape[:2]) != tiles:
                found.append(
                    f"trellis {list(trellis.shape)} does not tile the source weight {list(source.shape)} "
                    "(out, in) in 16×16 tiles: expected (in/16, out/16, 16·K)"
                )
            if trellis.shape[-1] % 8 or not 1 <= trellis.shape[-1] / 16 <= 8.5:
                found.append(f"trellis width {trellis.shape[-1]} is no EXL3 bitrate (16·K words, K in 1..8)")
            bits = bits_per_weight(trellis.shape)
            row.bits = row.bits_per_weight = bits
            if isinstance(bits, float) and "mul1" not in tensors:
                found.append(f"half-integer bitrate {bits} without the mul1 codebook")
        for full, packed, n in (("suh", "su", in_features), ("svh", "sv", out_features)):
            if full in tensors:
                info, want = tensors[full], ("F16", (n,))
            elif packed in tensors:
                info, want = tensors[packed], ("I16", (n // 16,))
            else:
                found.append(f"neither {full} nor {packed} is stored")
                continue
            if (info.dtype, info.shape) != want:
                found.append(
                    f"{info.name.rsplit('.', 1)[-1]} is {info.dtype} {list(info.shape)}, expected "
                    f"{want[0]} {list(want[1])}"
                )
        markers = [m for m in CODEBOOK_MULTIPLIERS if m in tensors]
        if len(markers) > 1:
            found.append("stores both the mcg and the mul1 codebook markers")
        for marker in markers:
            info = tensors[marker]
            value = int(reader.tensor(info).reshape(-1).view(np.uint32)[0]) if info.nbytes == 4 else None
            if value != CODEBOOK_MULTIPLIERS[marker]:
                shown = "not one 32-bit value" if value is None else f"{value:#010x}"
                found.append(f"{marker} marker holds {shown}, not {CODEBOOK_MULTIPLIERS[marker]:#010x}")
        row.codebook = markers[0] if len(markers) == 1 else "3inst" if not markers else "mixed"
        row.decode_exact = None
        return [Problem("config", source.name, p) for p in found]

    def check_config(self, rows: list[TensorRow]) -> tuple[list[Problem], dict[str, Any]]:
        """tensor_storage against the tensors and the trellis bitrates; codebook and per-part bit claims."""
        config, storage_problem = self.format.config, self.format.storage_problem
        problems: list[Problem] = []
        if storage_problem:
            problems.append(Problem("config", EXL3_CONFIG_FILE, storage_problem))
        codebook = config.get("codebook")
        seen_codebooks = set()
        for row in rows:
            if row.format != "exl3":
                continue
            name, module = row.name, row.module
            if row.codebook is None:
                continue  # an unreadable trellis: already a problem of its own
            seen_codebooks.add(row.codebook)
            if codebook is not None and row.codebook != codebook:
                problems.append(
                    Problem("config", name, f"stores the {row.codebook} codebook, the config says {codebook}")
                )
            claim_key = PART_CLAIMS.get(row.part)
            claim = config.get(claim_key) if claim_key else None
            if claim is not None and row.bits is not None and row.bits != claim:
                problems.append(Problem("config", name, f"{row.bits} bpw, but {claim_key} is {claim}"))
            if storage_problem:
                continue
            entry = self.format.storage.get(module)
            if not isinstance(entry, dict):
                problems.append(Problem("config", name, f"quantized, but {module} is not in tensor_storage"))
                continue
            problems += [Problem("config", name, p) for p in _entry_mismatches(entry, row)]
        if codebook is None and len(seen_codebooks) > 1:
            problems.append(
                Problem("config", "config.json", f"codebooks differ across tensors: {sorted(seen_codebooks)}")
            )
        problems += self._stored_tensor_mismatches()
        claims = {k: config[k] for k in ("bits", "head_bits", "codebook") if k in config}
        return problems, claims

    def _stored_tensor_mismatches(self) -> list[Problem]:
        """Every tensor tensor_storage lists exists with the shape, size and dtype it says."""
        problems = []
        tensors = self.format.candidate.tensors
        for module, entry in self.format.storage.items():
            stored = entry.get("stored_tensors") if isinstance(entry, dict) else None
            if not isinstance(stored, dict):
                problems.append(Problem("config", module, "tensor_storage entry without stored_tensors"))
                continue
            for name, meta in stored.items():
                info = tensors.get(name)
                if info is None:
                    problems.append(
                        Problem("config", name, f"listed in tensor_storage[{module!r}], not stored")
                    )
                    continue
                real = {
                    "shape": list(info.shape),
                    "n_bytes": info.nbytes,
                    "dtype": TORCH_DTYPE_NAMES.get(info.dtype, info.dtype),
                }
                meta = meta if isinstance(meta, dict) else {}
                for key in ("shape", "n_bytes", "dtype"):
                    if key in meta and meta[key] != real[key]:
                        problems.append(
                            Problem(
                                "config", name, f"tensor_storage says {key} {meta[key]}, stored {real[key]}"
                            )
                        )
        return problems


def _entry_mismatches(entry: dict[str, Any], row: TensorRow) -> list[str]:
    """A module's tensor_storage entry against its trellis bits and codebook marker."""
    found = []
    if entry.get("quant_format") != "exl3":
        found.append(f"tensor_storage says quant_format {entry.get('quant_format')!r}, the files hold exl3")
    claimed = entry.get("bits_per_weight")
    if claimed != row.bits:
        found.append(f"tensor_storage says {claimed} bpw, the trellis shape gives {row.bits} bpw")
    for marker, multiplier in CODEBOOK_MULTIPLIERS.items():
        said = entry.get(f"{marker}_multiplier")
        if (row.codebook == marker) != (said is not None) or said not in (None, multiplier):
            found.append(
                f"tensor_storage {marker}_multiplier is {said!r}, the files "
                f"{'hold' if row.codebook == marker else 'lack'} the {marker} marker"
            )
    return found
