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
dtype), and for an EXL3 module its `quant_format`, `bits_per_weight` and codebook multiplier. The tensors task
checks the stored tensors and these claims against each other (`evalsuite.tasks.tensor_verification`).
"""

from __future__ import annotations

import json
from typing import Any

from evalsuite.checkpoint import EXL3_CONFIG_FILE, Checkpoint

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
    """EXL3 as a `QuantizedFormat`, with the candidate's claims: `config` (config.json's
    `quantization_config`, else quantization_config.json's top level) and `storage` (`tensor_storage`), or
    `storage_problem` saying why there is none."""

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
