"""The floor that a streamed forward's bytes and arithmetic set on this machine (bench/real_shape.py).

A streamed forward does three things no implementation can skip: it reads its decoder layers' bytes (of a MoE
layer, the routed experts) from the page cache, a quantized side writes the BF16 they unpack to, and it runs
the matmuls of its tokens. Each has a rate on this machine, measured here in seconds, in the same call as the
runs it is read against where the bench measures them:

- `read`: a file already in the page cache read into a buffer of its own (`readinto`), the best of a few;
- `write`: a BF16 tensor already faulted in, filled (every byte written once), the best of a few;
- `matmul`: `tokens` rows of the model's hidden width through a BF16 weight of `moe_intermediate` outputs as
  `nn.Linear` runs it, at the decoding batch's rows and at a window's, the best of a few (floating-point
  operations per second, two per multiply-add).

The floor of a forward is the three in sequence: its bytes at the read rate, its unpacked bytes at the write
rate and its matmuls' operations at the matmul rate. The operations are those of the tokens through every
layer's parameters that a token uses (everything but the routed experts, and `num_experts_per_tok` of them),
from the layer's BF16 bytes and the text config; attention's own products over the sequence and the head are
left out (under a few percent at these lengths), so the floor stays below what any forward must take.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from figures import fastest

READ_BYTES = 256 * 2**20
WRITE_BYTES = 256 * 2**20
REPEATS = 5


def page_cache_read_rate(size: int = READ_BYTES, folder: Path | None = None) -> float:
    """Bytes per second read from a file held in the page cache (written, then read once, before timing)."""
    buffer = bytearray(size)
    with tempfile.NamedTemporaryFile(dir=folder, prefix="evalsuite-floor-", delete=False) as handle:
        handle.write(os.urandom(1 << 20) * (size >> 20))
        path = Path(handle.name)
    try:

        def read() -> None:
            with open(path, "rb", buffering=0) as f:
                f.readinto(buffer)

        return size / fastest(read, REPEATS)
    finally:
        path.unlink()


def bf16_write_rate(size: int = WRITE_BYTES) -> float:
    """Bytes per second written into a BF16 tensor whose pages are already mapped."""
    tensor = torch.empty(size // 2, dtype=torch.bfloat16)
    return size / fastest(lambda: tensor.fill_(1.0), REPEATS)


def matmul_rate(tokens: int, hidden: int, columns: int) -> float:
    """Floating-point operations per second of a BF16 `tokens` × `hidden` input through a `columns` × `hidden`
    weight as `nn.Linear` runs it (`F.linear`: on an AVX2 CPU, torch's `x @ w` in BF16 takes another, far
    slower kernel; the floor is the fastest BF16 path the machine has)."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, hidden, generator=generator).to(torch.bfloat16)
    w = torch.randn(columns, hidden, generator=generator).to(torch.bfloat16)
    return 2 * tokens * hidden * columns / fastest(lambda: torch.nn.functional.linear(x, w), REPEATS)


def machine_rates(text_config: dict[str, Any], decoding_tokens: int, window_tokens: int) -> dict[str, Any]:
    """The three rates (module docstring) on this machine now, the matmul at the decoding batch's rows and at
    a window's; with the load average when they were taken."""
    hidden = int(text_config.get("hidden_size", 2048))
    columns = int(text_config.get("moe_intermediate_size", 512))
    return {
        "read_bytes_per_second": page_cache_read_rate(),
        "write_bytes_per_second": bf16_write_rate(),
        "matmul_flops_per_second": {
            "decoding": matmul_rate(decoding_tokens, hidden, columns),
            "window": matmul_rate(window_tokens, hidden, columns),
        },
        "decoding_tokens": decoding_tokens,
        "window_tokens": window_tokens,
        "load_average": list(os.getloadavg()),
    }


def active_parameters(layer_bf16_bytes: float, text_config: dict[str, Any]) -> float:
    """Parameters of a decoder layer that one token goes through: the layer's (its BF16 bytes / 2) less the
    routed experts it does not use."""
    hidden = int(text_config.get("hidden_size", 2048))
    expert = 3 * hidden * int(text_config.get("moe_intermediate_size", 0))
    experts = int(text_config.get("num_experts", 0))
    used = int(text_config.get("num_experts_per_tok", 0))
    return layer_bf16_bytes / 2 - (experts - used) * expert


def floor_seconds(
    rates: dict[str, Any], read: float, written: float, tokens: int, parameters: float, shape: str
) -> dict[str, float]:
    """The floor of reading `read` bytes, writing `written` BF16 bytes and running `tokens` tokens through
    `parameters` parameters at the `shape` matmul rate ("decoding" or "window"), and its three parts."""
    parts = {
        "read": read / rates["read_bytes_per_second"],
        "write": written / rates["write_bytes_per_second"],
        "matmul": 2 * tokens * parameters / rates["matmul_flops_per_second"][shape],
    }
    return {"seconds": sum(parts.values()), **parts}
