"""EXL3 (exllamav3) on disk: what a quantized Linear stores, its bits per weight, and the config's claims.

As exllamav3 writes it (`modules/quant/exl3.py`, `conversion/quant_config.py`, `conversion/compile.py`): a
quantized Linear `X` stores `X.trellis`, int16 of shape (in/16, out/16, 16·K): one 16×16 tile of the weight
in 256·K bits, so K = shape[-1] / 16 bits per weight (16·K + 8 words for the half-integer rates, which need
the mul1 codebook); `X.suh` / `X.svh` (float16 sign-and-scale vectors over the input and output features) or
their packed forms `X.su` / `X.sv` (int16, one bit per feature); `X.mcg` or `X.mul1`, a scalar whose 32 bits
are the codebook's multiplier and whose presence selects that codebook (none: the 3INST codebook); `X.bias`
kept beside them. config.json's `quantization_config` claims `bits` (the average over the decoder's Linear
layers, head excluded), `head_bits`, `codebook` and, where set, `vision_bits` / `mtp_bits`;
`quantization_config.json` repeats it with `tensor_storage`: per module its `stored_tensors` (shape, n_bytes,
dtype), and for an EXL3 module its `quant_format`, `bits_per_weight` and codebook multiplier. There is no CPU
decoder for trellises, so EXL3 weights are classified and checked here, not decoded.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from evalsuite.checkpoint import EXL3_CONFIG_FILE, Checkpoint, TensorInfo
from evalsuite.formats import Problem, ShardReader

PARAMS = frozenset({"trellis", "suh", "svh", "su", "sv", "mcg", "mul1"})
MARKS = frozenset({"trellis"})
# exllamav3's locked codebook multipliers (exl3_lib/quantize.py), stored as int32 scalars.
CODEBOOK_MULTIPLIERS = {"mcg": 0xCBAC1FED, "mul1": 0x83DCD12D}
# The dtype strings exllamav3 writes into tensor_storage (str(torch dtype)) for safetensors dtypes.
TORCH_DTYPE_NAMES = {
    "BF16": "torch.bfloat16",
    "F16": "torch.float16",
    "F32": "torch.float32",
    "I16": "torch.int16",
    "I32": "torch.int32",
    "I64": "torch.int64",
    "I8": "torch.int8",
    "U8": "torch.uint8",
}
# Parts of the model whose bits have a claim of their own in the config.
PART_CLAIMS = {"head": "head_bits", "vision": "vision_bits", "mtp": "mtp_bits"}


def bits_per_weight(trellis_shape: tuple[int, ...]) -> float | int:
    """K = shape[-1] / 16 bits per weight, an int when whole (as exllamav3 writes it)."""
    bpw = trellis_shape[-1] / 16
    return int(bpw) if bpw.is_integer() else bpw


class Exl3:
    """The format handler of EXL3 checkpoints (see `evalsuite.formats.FormatHandler`)."""

    name = "exl3"
    params = PARAMS
    marks = MARKS

    def __init__(self, candidate: Checkpoint) -> None:
        self.candidate = candidate
        self.config = candidate.quantization_config or {}
        path = candidate.path / EXL3_CONFIG_FILE
        self.storage_problem: str | None = None
        self.storage: dict[str, Any] = {}
        try:
            document = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            self.storage_problem = f"no {EXL3_CONFIG_FILE}: the per-tensor bitrates cannot be checked"
        except ValueError as exc:
            self.storage_problem = f"{EXL3_CONFIG_FILE} is not valid JSON ({exc})"
        else:
            storage = document.get("tensor_storage") if isinstance(document, dict) else None
            if isinstance(storage, dict):
                self.storage = storage
            else:
                self.storage_problem = f"{EXL3_CONFIG_FILE} has no tensor_storage object"
            if not self.config and isinstance(document, dict):
                self.config = {k: v for k, v in document.items() if k != "tensor_storage"}

    def measure(
        self, source: TensorInfo, tensors: dict[str, TensorInfo], reader: ShardReader, row: dict[str, Any]
    ) -> list[Problem]:
        """Bits from the trellis shape; the trellis, sign vectors and codebook marker against the source."""
        found: list[str] = []
        trellis = tensors.get("trellis")
        row.update(format="exl3", codebook=None, note="no CPU decoder for EXL3 trellises")
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
            row.update(bits=bits, bits_per_weight=bits)
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
        row["codebook"] = markers[0] if len(markers) == 1 else "3inst" if not markers else "mixed"
        row["decode_exact"] = None
        return [Problem("config", source.name, p) for p in found]

    def check_config(self, rows: list[dict[str, Any]]) -> tuple[list[Problem], dict[str, Any]]:
        """tensor_storage against the tensors and the trellis bitrates; codebook and per-part bit claims."""
        problems: list[Problem] = []
        if self.storage_problem:
            problems.append(Problem("config", EXL3_CONFIG_FILE, self.storage_problem))
        codebook = self.config.get("codebook")
        seen_codebooks = set()
        for row in rows:
            if row.get("format") != "exl3":
                continue
            name, module = row["name"], row["module"]
            if row["codebook"] is None:
                continue  # an unreadable trellis: already a problem of its own
            seen_codebooks.add(row["codebook"])
            if codebook is not None and row["codebook"] != codebook:
                problems.append(
                    Problem(
                        "config", name, f"stores the {row['codebook']} codebook, the config says {codebook}"
                    )
                )
            claim_key = PART_CLAIMS.get(row["part"])
            claim = self.config.get(claim_key) if claim_key else None
            if claim is not None and row["bits"] is not None and row["bits"] != claim:
                problems.append(Problem("config", name, f"{row['bits']} bpw, but {claim_key} is {claim}"))
            if self.storage_problem:
                continue
            entry = self.storage.get(module)
            if not isinstance(entry, dict):
                problems.append(Problem("config", name, f"quantized, but {module} is not in tensor_storage"))
                continue
            problems += [Problem("config", name, p) for p in self._entry_mismatches(entry, row)]
        if codebook is None and len(seen_codebooks) > 1:
            problems.append(
                Problem("config", "config.json", f"codebooks differ across tensors: {sorted(seen_codebooks)}")
            )
        problems += self._stored_tensor_mismatches()
        claims = {k: self.config[k] for k in ("bits", "head_bits", "codebook") if k in self.config}
        return problems, claims

    def _entry_mismatches(self, entry: dict[str, Any], row: dict[str, Any]) -> list[str]:
        found = []
        if entry.get("quant_format") != "exl3":
            found.append(
                f"tensor_storage says quant_format {entry.get('quant_format')!r}, the files hold exl3"
            )
        claimed = entry.get("bits_per_weight")
        if claimed != row["bits"]:
            found.append(f"tensor_storage says {claimed} bpw, the trellis shape gives {row['bits']} bpw")
        for marker, multiplier in CODEBOOK_MULTIPLIERS.items():
            said = entry.get(f"{marker}_multiplier")
            if (row["codebook"] == marker) != (said is not None) or said not in (None, multiplier):
                found.append(
                    f"tensor_storage {marker}_multiplier is {said!r}, the files "
                    f"{'hold' if row['codebook'] == marker else 'lack'} the {marker} marker"
                )
        return found

    def _stored_tensor_mismatches(self) -> list[Problem]:
        """Every tensor tensor_storage lists exists with the shape, size and dtype it says."""
        problems = []
        tensors = self.candidate.tensors
        for module, entry in self.storage.items():
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
