"""Integer modules of backend `intref`: W4A8 / W8A8 Linear layers and routed experts in integer arithmetic.

The arithmetic, written once here and emulated independently in float64 by the exactness tests:

- activations, per token (row) `x` of K values in the compute dtype, taken to FP32 (exact from bf16/fp16):
  `s = fp32(max|x| / divisor)`, `q = clamp(round(fp32(x / s)), -128, 127)` as int8. The divisor (127.5 for
  compressed-tensors' symmetric INT8, whose scale is max / ((127 - (-128)) / 2); 127 elsewhere) and the
  rounding (half to even, or half away from zero) are parameters. A row of zeros has s = 0 and q = 0.
- weights: int8 in [-8, 7] (INT4) or in [-128, 127] (INT8), unpacked from compressed-tensors' `pack-quantized`
  int32 words or stored as int8 (`int-quantized`, INT4 values too), with one scale per output channel or per
  group of input columns as stored (bf16), and for asymmetric schemes one integer zero point z per scale.
- per channel: `acc = q @ w.T` accumulated in INT32 (`torch._int_mm`, or an exact float64 product where
  `_int_mm` does not take the shapes). No overflow is possible: |acc| <= K * 128 * 128, and K is checked
  against that at load. `y = (fp32(acc) * s_x) * s_w` in FP32 (two roundings to FP32, in this order).
- per group g of G columns: `acc_g = q_g @ w_g.T − (Σ q_g) z_g`, exact integers (the zero point handled in
  integers, never as a float offset), each scaled as above by its group's scale, `y = Σ_g (fp32(acc_g) * s_x)
  * s_w,g` summed in FP32 in group order; per channel with a zero point, the same with one group. A weight
  quantized in activation order with its groups' columns scattered (GPTQ's `actorder: "group"`) stores
  `weight_g_idx`, the group of each input column: group g is then the columns whose g_idx is g, gathered
  (in column order) before the same per-group accumulation. Integer sums do not depend on the order.
- plus the bias in FP32 if there is one, then cast to the model's compute dtype.

Routed experts (`IntExperts`) run each expert's gate, up and down projections this way, in a fixed expert
order (0, 1, …), multiply the FP32 output of the down projection by the routing weight and reduce into an FP32
buffer, cast to the compute dtype once at the end: the sum never depends on thread scheduling.

Packed weights stay packed in memory: a layer unpacks its INT4 words into a transient int8 matrix as it runs.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

Rounding = Literal["half_even", "half_away_from_zero"]
QMIN, QMAX = -128, 127
# The largest K whose INT32 accumulator cannot overflow with int8 activations and int8 weights.
MAX_IN_FEATURES = (2**31 - 1) // (128 * 128)


@dataclass(frozen=True)
class ActivationQuant:
    """How activations become int8: the per-token scale is max|x| / `divisor`, values round by `rounding`."""

    divisor: float = 127.5
    rounding: Rounding = "half_even"


def round_to_int(r: torch.Tensor, rounding: Rounding) -> torch.Tensor:
    """Round FP32 values to integers (still FP32), ties to even or away from zero; exact for any input."""
    if rounding == "half_even":
        return torch.round(r)  # IEEE round-half-even
    if rounding == "half_away_from_zero":
        # floor(|r| + 0.5) would take r = 0.5 - 2^-25 to 1 (the sum rounds in FP32); the fraction is exact.
        t = torch.trunc(r)
        return t + torch.sign(r) * ((r - t).abs() >= 0.5)
    raise ValueError(f"unknown rounding {rounding!r}")


def quantize_activations(x: torch.Tensor, act: ActivationQuant) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row symmetric INT8 quantization of a 2-D activation: (q int8 (M, K), scale FP32 (M,))."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1) / act.divisor
    # A row of zeros quantizes to zeros whatever its scale; 1 avoids 0/0 and its output is 0 × anything.
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = round_to_int(xf / safe[:, None], act.rounding).clamp_(QMIN, QMAX).to(torch.int8)
    return q, scale


def unpack_int4(packed: torch.Tensor, in_features: int) -> torch.Tensor:
    """compressed-tensors `pack-quantized` words (out, ceil(in/8)) int32 → int8 weights (out, in) in [-8, 7].

    Each int32 holds eight 4-bit values, offset-binary (q + 8), least significant nibble first: read as
    little-endian bytes, byte j holds value 2j in its low nibble and 2j + 1 in its high nibble.
    """
    if sys.byteorder != "little":  # pragma: no cover - every platform torch ships on is little-endian
        shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
        nibbles = (packed[..., None] >> shifts) & 0xF
        return (nibbles.to(torch.int8).reshape(packed.shape[0], -1)[:, :in_features]) - 8
    raw = packed.contiguous().view(torch.uint8)  # (out, 4 * words)
    nibbles = torch.stack((raw & 0xF, raw >> 4), dim=-1).reshape(packed.shape[0], -1)
    return nibbles[:, :in_features].view(torch.int8) - 8


def unpack_words(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """compressed-tensors `pack-quantized` int32 words (rows, ceil(count·b/32)) → int8 values (rows, count),
    offset binary (q + 2^(b−1)), least significant bits first: INT4 by `unpack_int4`, INT8 one byte each."""
    if bits == 4:
        return unpack_int4(packed, count)
    if bits != 8:
        raise ValueError(f"packed integer weights are 4 or 8 bits, not {bits}")
    raw = packed.contiguous().view(torch.uint8).reshape(packed.shape[0], -1)[:, :count]
    return (raw.to(torch.int16) - 128).to(torch.int8)


def int_group_accumulators(
    q: torch.Tensor, w: torch.Tensor, group_size: int, zero_point: torch.Tensor | None
) -> torch.Tensor:
    """Exact per-group accumulators (groups, M, N) of int8 q (M, K) and int8 w (N, K), zero points (N, groups)
    subtracted in integers: `q_g @ w_g.T − (Σ q_g) z_g`.

    A float64 batched product: every partial sum is an integer below 2^53 (K * 128 * 256 < 2^31), so it is
    exact whatever order the kernel sums in.
    """
    m, k = q.shape
    n = w.shape[0]
    groups = -(-k // group_size)
    pad = groups * group_size - k
    qd, wd = q.double(), w.double()
    if pad:
        qd = torch.nn.functional.pad(qd, (0, pad))
        wd = torch.nn.functional.pad(wd, (0, pad))
    qg = qd.reshape(m, groups, group_size).transpose(0, 1)  # (G, M, gs)
    wg = wd.reshape(n, groups, group_size).permute(1, 2, 0)  # (G, gs, N)
    acc = torch.bmm(qg, wg)
    if zero_point is not None:
        acc -= qg.sum(dim=-1, keepdim=True) * zero_point.double().t()[:, None, :]
    return acc


def int_matmul(q: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Exact INT32 `q @ w.T` of int8 q (M, K) and int8 w (N, K).

    `torch._int_mm` where it takes the shapes (CPU: any; CUDA: M > 16, K and N multiples of 8); otherwise a
    float64 product, exact because every partial sum is an integer below 2^53 (K * 128 * 128 < 2^31).
    """
    m, k = q.shape
    n = w.shape[0]
    if m == 0:
        return torch.zeros((0, n), dtype=torch.int32, device=q.device)
    if q.device.type == "cpu" or (q.device.type == "cuda" and m > 16 and k % 8 == 0 and n % 8 == 0):
        return torch._int_mm(q, w.t())
    return (q.double() @ w.double().t()).to(torch.int32)


def int_linear_fp32(
    q: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(INT32 accumulator (M, N), FP32 output (M, N)) of quantized activations and int8 weights."""
    acc = int_matmul(q, w)
    y = acc.float().mul_(x_scale[:, None]).mul_(w_scale.float().reshape(1, -1))
    return acc, y


class IntLinear(nn.Module):
    """A compressed-tensors quantized Linear executed in integer arithmetic, weights as stored in the file.

    Buffers carry the checkpoint's own names, so the module's state dict is the checkpoint's tensors: packed
    `weight_packed` (int32 words) or int8 `weight` (`storage`), `weight_scale` (out, groups) in its stored
    dtype and, for an asymmetric scheme, `weight_zero_point` (packed along the rows for packed storage).
    `group_size` None is one scale per output channel. `calls` counts forwards, so a run can show which layers
    went through the integer path.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bits: int,
        act: ActivationQuant,
        out_dtype: torch.dtype,
        bias: bool = False,
        group_size: int | None = None,
        zero_point: bool = False,
        storage: Literal["packed", "int8"] | None = None,
        g_idx: bool = False,
    ) -> None:
        super().__init__()
        if bits not in (4, 8):
            raise ValueError(f"integer weights are 4 or 8 bits, not {bits}")
        if in_features > MAX_IN_FEATURES:
            raise ValueError(f"{in_features} input features could overflow the INT32 accumulator")
        self.in_features, self.out_features, self.bits = in_features, out_features, bits
        self.act, self.out_dtype = act, out_dtype
        # The seed's layout by default: INT4 packed, INT8 as int8.
        self.storage = storage or ("packed" if bits == 4 else "int8")
        self.group_size = group_size
        self.has_zero_point = zero_point
        groups = 1 if group_size is None else -(-in_features // group_size)
        # Placeholders on the meta device: the loader replaces each with the tensor read from the file, and
        # one still on meta afterwards is a tensor the file did not provide.
        meta = {"device": "meta"}
        if self.storage == "packed":
            words = -(-in_features * bits // 32)
            self.register_buffer(
                "weight_packed", torch.empty((out_features, words), dtype=torch.int32, **meta)
            )
        else:
            self.register_buffer("weight", torch.empty((out_features, in_features), dtype=torch.int8, **meta))
        self.register_buffer(
            "weight_scale", torch.empty((out_features, groups), dtype=torch.bfloat16, **meta)
        )
        if zero_point:
            if self.storage == "packed":
                zp_shape, zp_dtype = (-(-out_features * bits // 32), groups), torch.int32
            else:
                zp_shape, zp_dtype = (out_features, groups), torch.int8
            self.register_buffer("weight_zero_point", torch.empty(zp_shape, dtype=zp_dtype, **meta))
        self.has_g_idx = g_idx
        if g_idx:
            if group_size is None:
                raise ValueError("a group index needs groups: per-channel scales do not depend on the column")
            self.register_buffer("weight_g_idx", torch.empty(in_features, dtype=torch.int32, **meta))
        self._column_order: torch.Tensor | None = None
        self.bias = nn.Parameter(torch.empty(out_features, **meta), requires_grad=False) if bias else None
        self.calls = 0
        # While `keep_unpacked` (a streamed layer, resident for one pass over every window): the packed words
        # unpacked once, at the first forward or by its experts module's `unpack_together`, and reused by
        # every later window until the layer is freed (`drop_unpacked`). A loaded model keeps its weights
        # packed, as the file stores them, and unpacks at each forward.
        self.keep_unpacked = False
        self._unpacked: torch.Tensor | None = None

    def __getattr__(self, name: str) -> torch.Tensor | nn.Module:
        # Code that only reads `lm_head.weight.shape` (Transformers, HFBackend's vocabulary size) sees the
        # logical INT4 shape on the meta device: the values exist only packed.
        if name == "weight" and "weight_packed" in self.__dict__.get("_buffers", {}):
            return torch.empty((self.out_features, self.in_features), dtype=torch.int8, device="meta")
        return super().__getattr__(name)

    def int8_weight(self) -> torch.Tensor:
        """The weights as int8 (out, in): for packed storage unpacked now (transient) or, while
        `keep_unpacked`, once for the layer's residency; else as stored."""
        if self.storage != "packed":
            return self._buffers["weight"]
        if self._unpacked is not None:
            return self._unpacked
        unpacked = unpack_words(self._buffers["weight_packed"], self.bits, self.in_features)
        if self.keep_unpacked:
            self._unpacked = unpacked
        return unpacked

    def drop_unpacked(self) -> None:
        """Forget the weights unpacked for the layer's residency (the layer is being freed)."""
        self._unpacked = None

    def zero_points(self) -> torch.Tensor | None:
        """The integer zero points (out, groups), unpacked from along the rows for packed storage."""
        if not self.has_zero_point:
            return None
        zp = self._buffers["weight_zero_point"]
        if self.storage == "packed":
            return unpack_words(zp.t().contiguous(), self.bits, self.out_features).t()
        return zp

    def column_order(self) -> torch.Tensor | None:
        """The input columns gathered group by group (columns of group 0, then 1, …), for a stored
        `weight_g_idx`; None without one. Raises ValueError for a g_idx whose groups are not those of
        `group_size` columns each (the last may be short), as GPTQ writes them."""
        if not self.has_g_idx:
            return None
        stored = self._buffers["weight_g_idx"]
        # Cached per device: `.to(device)` moves the buffer, not this derived index.
        if self._column_order is None or self._column_order.device != stored.device:
            g_idx = stored.long()
            assert self.group_size is not None
            groups = -(-self.in_features // self.group_size)
            natural = torch.arange(self.in_features, device=g_idx.device) // self.group_size
            if (
                g_idx.min() < 0
                or g_idx.max() >= groups
                or not torch.equal(
                    torch.bincount(g_idx, minlength=groups), torch.bincount(natural, minlength=groups)
                )
            ):
                raise ValueError(f"weight_g_idx does not assign {self.group_size} columns to each group")
            self._column_order = torch.argsort(g_idx, stable=True)
        return self._column_order

    def accumulate(self, q: torch.Tensor, x_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(accumulator: INT32 (M, out), or per group INT64 (groups, M, out), exact; FP32 output (M, out))
        of activations already quantized to int8."""
        self.calls += 1
        if self.group_size is None and not self.has_zero_point:
            acc, y = int_linear_fp32(q, x_scale, self.int8_weight(), self.weight_scale)
        else:
            group_size = self.group_size or self.in_features
            w = self.int8_weight()
            order = self.column_order()
            if order is not None:
                q, w = q[:, order], w[:, order]
            acc = int_group_accumulators(q, w, group_size, self.zero_points())
            scales = self.weight_scale.float()
            y = torch.zeros((q.shape[0], self.out_features), dtype=torch.float32, device=q.device)
            for g in range(acc.shape[0]):  # fixed order: the FP32 sum is deterministic
                y += acc[g].float().mul_(x_scale[:, None]).mul_(scales[:, g].reshape(1, -1))
            acc = acc.to(torch.int64)  # exact: a zero point can take a long group past INT32
        if self.bias is not None:
            y += self.bias.float()
        return acc, y

    def run(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(INT32 accumulator, FP32 output) of a 2-D activation (M, in): what `forward` casts and returns."""
        q, x_scale = quantize_activations(x, self.act)
        return self.accumulate(q, x_scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _, y = self.run(x.reshape(-1, self.in_features))
        return y.to(self.out_dtype).reshape(*x.shape[:-1], self.out_features)

    def convention(self) -> str:
        """The weight side of the integer arithmetic, e.g. `W4 group 64 asymmetric`."""
        parts = [f"W{self.bits}", "channel" if self.group_size is None else f"group {self.group_size}"]
        if self.has_zero_point:
            parts.append("asymmetric")
        if self.has_g_idx:
            parts.append("g_idx")
        return " ".join(parts)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, {self.convention()}A8, "
            f"divisor={self.act.divisor}, rounding={self.act.rounding}"
        )


class IntExpert(nn.Module):
    """One routed expert: gate, up and down projections (the checkpoint's `experts.N.*_proj` modules)."""

    def __init__(self, gate_proj: IntLinear, up_proj: IntLinear, down_proj: IntLinear) -> None:
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = gate_proj, up_proj, down_proj


class IntExperts(nn.Module):
    """Routed experts in integer arithmetic; a drop-in for Transformers' fused experts modules.

    Called as Transformers calls its experts (`hidden_states (T, H)`, `top_k_index (T, k)`, `top_k_weights
    (T, k)`) and returns (T, H) in the compute dtype. The experts are children named `0`, `1`, … as in the
    checkpoint (`experts.N.gate_proj…`). `tokens[e]` counts the tokens expert e has processed.
    """

    def __init__(self, experts: list[IntExpert], act_fn: nn.Module, out_dtype: torch.dtype) -> None:
        super().__init__()
        for e, expert in enumerate(experts):
            self.add_module(str(e), expert)
        self.num_experts = len(experts)
        self.act_fn = act_fn
        self.out_dtype = out_dtype
        self.tokens = [0] * len(experts)

    def experts(self) -> list[IntExpert]:
        """The experts in their fixed order."""
        return [self._modules[str(e)] for e in range(self.num_experts)]  # type: ignore[misc]

    def unpack_together(self) -> None:
        """Each projection's packed words of every expert unpacked in one step, kept by each expert's
        `IntLinear` for the layer's residency (`keep_unpacked`): a pass runs every window through hundreds of
        experts, and unpacking them one module at a time and once per window was most of its integer
        arithmetic. Unpacking is row-local (`unpack_words`), so the stacked rows give each expert's own."""
        for projection in ("gate_proj", "up_proj", "down_proj"):
            linears = [getattr(expert, projection) for expert in self.experts()]
            first = linears[0]
            if first.storage != "packed" or any(
                m.storage != "packed" or m.bits != first.bits or m.in_features != first.in_features
                or m._buffers["weight_packed"].shape != first._buffers["weight_packed"].shape
                for m in linears
            ):  # fmt: skip
                continue
            words = torch.stack([m._buffers["weight_packed"] for m in linears])
            unpacked = unpack_words(words.reshape(-1, words.shape[-1]), first.bits, first.in_features)
            for m, weight in zip(linears, unpacked.reshape(len(linears), -1, first.in_features), strict=True):
                m.keep_unpacked = True
                m._unpacked = weight

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        out = torch.zeros(hidden_states.shape, dtype=torch.float32, device=hidden_states.device)
        for e, expert in enumerate(self.experts()):  # fixed order: the FP32 sum is deterministic
            token_idx, slot = torch.where(top_k_index == e)
            if token_idx.numel() == 0:
                continue
            self.tokens[e] += int(token_idx.numel())
            q, x_scale = quantize_activations(hidden_states[token_idx], expert.gate_proj.act)
            # gate and up read the same input: quantized once. Their outputs are cast to the compute dtype and
            # combined there, as Transformers' MLPs do with the outputs of two Linear layers.
            gate = expert.gate_proj.accumulate(q, x_scale)[1].to(self.out_dtype)
            up = expert.up_proj.accumulate(q, x_scale)[1].to(self.out_dtype)
            h = self.act_fn(gate) * up
            _, y = expert.down_proj.run(h)
            y *= top_k_weights[token_idx, slot].float()[:, None]
            out.index_add_(0, token_idx, y)  # one row per token for a given expert: no two writes collide
        return out.to(self.out_dtype)
