"""Exact CPU decode of EXL3 (exllamav3) trellis weights, in pure torch and vectorised over all tiles.

Each step below follows a named piece of exllamav3's source, read at v1.6.5 (the PyPI wheel) and at the
v1.4.1 GitHub tree; the integer-bitrate path is the same in both. File paths are relative to the package
`exllamav3/`; the extension's sources are under `exllamav3_ext/quant/`.

1. Codebook, 16-bit state -> fp16 value (`codebook.cuh`, `decode_3inst<cb>`; cb 0 = 3INST, 1 = mcg, 2 = mul1).
   With x the state as a uint32:
   - 3INST: x = x*89226354 + 64248484; mcg: x = x*0xCBAC1FED (both mod 2^32); then
     x = (x & 0x8fff8fff) ^ 0x3b603b60 (the `lop3 ... 0x6a` is (a & b) ^ c) and the value is
     `__hadd` of the fp16 numbers in the low and the high 16 bits;
   - mul1: x = x*0x83DCD12D (mod 2^32); h = the fp16 with bits 0x6400 + (sum of the four bytes of x)
     (`__dp4a(x, 0x01010101, 0x6400)`), value = `__hfma(h, fp16 0x1eee, fp16 0xc931)`.
   Both are computed here exactly in float32 and rounded once to fp16, which is what the GPU's single
   rounding gives: the 3INST halves have exponents 2^-3..2^0, so their float32 sum is exact; for mul1,
   h * 0x1eee is an integer times 2^-18 below 2^22 and adding 0xc931 (an integer times 2^-7) stays an
   integer times 2^-18 below 2^23, exact in float32. The RMS of the 3INST table is `codebook_scale`
   (1.24371088) of `modules/quant/exl3_lib/quantize.py`; the multipliers are its `codebook_mcg_mult` and
   `codebook_mul1_mult`. One 65,536-entry table per codebook is built once and cached.
2. Bitstream (`pack.cu`, `pack_trellis_kernel`; `exl3_dq.cuh`, `dq` / `dq8`). A tile of 256 weights at K
   bits is a ring of 256*K bits in 16*K int16 words. The packer writes the low K bits of each state,
   MSB first, into uint16 words and stores every pair of them with `SWAP16` (`util.cuh`:
   `__byte_perm(x, 0, 0x1032)`), so that a little-endian uint32 load sees an MSB-first 32-bit word: uint32
   word i is `(w[2i+1] << 16) | w[2i]` of the stored uint16 words w, and stream bit b is bit 31 - b % 32 of
   word b // 32.
3. Tail-biting states (`exl3_dq.cuh`, `dq`: word0 starts at `t*K + K - 16 + 256*K`). The state at sequence
   position t is the 16-bit window of the ring that ends at bit (t+1)*K, read modulo 256*K; equivalently
   s_t = ((s_{t-1} << K) | sym_t) & 0xffff around the ring.
4. Tile layout (`modules/quant/exl3_lib/quantize.py`, `tensor_core_perm` and `ldlq`; `reconstruct.cu`,
   `reconstruct_kernel`'s shuffle). Sequence position p holds element perm[p] of the 16x16 tile, row-major
   r*16 + c with r along the input features and c along the output features; the trellis is laid out
   (in/16, out/16), so tile (i, j) covers W_hat[16i:16i+16, 16j:16j+16] of W_hat (in, out).
5. Half-integer bitrates (in 1.6.5, not yet in 1.4.1: `frac.cu`, `exl3_dq.cuh` `dq8_half`, `bits_k.cuh`,
   `quantize.py` `frac_k`; mul1 only). K = KA + 0.5 for KA in 1..3, 16*KA + 8 words per tile; position i
   takes KA + bit (i mod 16) of 0xAAAA new bits (odd positions one more), and its window ends at the prefix
   sum S(i) of those widths. Same MSB-first 32-bit stream words.
6. Dense weight (`modules/quant/exl3.py`, `LinearEXL3.get_weight_tensor`; `quantize.py`, `preapply_had_l`,
   `preapply_had_r`, `had_k = had_n = 128`; `util/hadamard.py`, `get_hadamard`, Sylvester's construction
   from `hadamard_1.txt` = [[1]]): W (in, out) = diag(suh) · H · W_hat · H · diag(svh), H block-diagonal of
   the 128-point Sylvester matrix scaled by 1/sqrt(128). exllamav3 rounds to fp16 between those steps; here
   they run in float32 (the two 1/sqrt(128) become one exact 1/128), so dense weights agree with exllamav3's
   to fp16 rounding, and W_hat bit for bit.
7. Sign vectors: `suh` / `svh` fp16 (scales folded in) or, in older packs, `su` / `sv` int16 bitfields
   (`exl3.py`, `LinearEXL3.unpack_bf`; `pack.cu`, `pack_signs_kernel`): bit i of word j is the sign of
   element 16*j + i, a set bit meaning -1; their values are ±1.
8. Padding (`modules/linear.py`, `Linear.__init__` with `pad_to = 128`, `Linear.pad_out`): both feature
   counts are padded with zeros to multiples of 128 before quantization, so the trellis has
   (ceil128(in)/16, ceil128(out)/16) tiles and `suh` / `svh` have the padded lengths. The HF weight
   (out, in) is W[:in, :out].T.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import torch

from evalsuite.errors import InputError

# The one home of EXL3's constants and bitrate rule: `formats.exl3`, the verification, the backend and the
# fixtures' encoder import them from here.
CODEBOOKS = ("3inst", "mcg", "mul1")
MCG_MULTIPLIER = 0xCBAC1FED
MUL1_MULTIPLIER = 0x83DCD12D
# exllamav3's locked codebook multipliers (exl3_lib/quantize.py), stored as int32 scalars whose presence
# selects the codebook.
CODEBOOK_MULTIPLIERS = {"mcg": MCG_MULTIPLIER, "mul1": MUL1_MULTIPLIER}
HADAMARD_SIZE = 128
TILE = 16
HALF_BITRATES = (1.5, 2.5, 3.5)
# Tiles decoded per step: bounds the int32 temporaries to a few tens of MB.
_CHUNK_TILES = 16384
# Elements of a block of decoded rows (at least one 128-row Hadamard block): 4 MB of float32.
BLOCK_ELEMENTS = 1 << 20

Bits = int | float


def padded(features: int) -> int:
    """A feature count padded to a multiple of 128, as exllamav3 pads a quantized Linear before quantizing
    it (`modules/linear.py`, `Linear.__init__`, `pad_to = 128`)."""
    return -(-features // HADAMARD_SIZE) * HADAMARD_SIZE


def bits_of_width(words: int) -> Bits | None:
    """K of a trellis whose tiles are `words` int16 words wide: words / 16 for K in 1..8 (an int), 1.5, 2.5
    or 3.5 for 24, 40 or 56 words (mul1 only); None for any other width. The only bitrate reader: what
    `conversion/quant_config.py` writes as `bits_per_weight` (shape[-1] / 16, an int when whole)."""
    if words % 16 == 0 and 1 <= words // 16 <= 8:
        return words // 16
    if words % 16 == 8 and words / 16 in HALF_BITRATES:
        return words / 16
    return None


def _fp16_from_bits(bits: torch.Tensor) -> torch.Tensor:
    """float32 values of fp16 numbers given as bit patterns 0..65535 in an integer tensor."""
    signed = torch.where(bits >= 0x8000, bits - 0x10000, bits).to(torch.int16)
    return signed.view(torch.float16).to(torch.float32)


@functools.cache
def _table(name: str) -> torch.Tensor:
    x = torch.arange(65536, dtype=torch.int64)
    if name == "mul1":
        x = (x * MUL1_MULTIPLIER) & 0xFFFFFFFF
        byte_sum = (x & 0xFF) + ((x >> 8) & 0xFF) + ((x >> 16) & 0xFF) + (x >> 24)
        h = _fp16_from_bits(0x6400 + byte_sum)
        scale = _fp16_from_bits(torch.tensor(0x1EEE))
        bias = _fp16_from_bits(torch.tensor(0xC931))
        values = h * scale + bias
    else:
        x = (x * 89226354 + 64248484) if name == "3inst" else (x * MCG_MULTIPLIER)
        x = ((x & 0xFFFFFFFF) & 0x8FFF8FFF) ^ 0x3B603B60
        values = _fp16_from_bits(x & 0xFFFF) + _fp16_from_bits(x >> 16)
    return values.to(torch.float16)


def codebook_table(name: str) -> torch.Tensor:
    """The 65,536 fp16 values of codebook `name` ("3inst", "mcg" or "mul1"), indexed by 16-bit state.

    Bit for bit what exllamav3's `decode_3inst<cb>` returns on the GPU. Built once per process; the
    returned tensor is a copy the caller may modify.
    """
    _check_codebook(name)
    return _table(name).clone()


def codebook_of(tensor_names: Iterable[str]) -> str:
    """The codebook of one quantized Linear from the names of its stored tensors.

    A `mcg` tensor selects "mcg", a `mul1` tensor "mul1", neither "3inst" (exllamav3's `LinearEXL3` reads
    only their presence). Names may be bare (`mcg`) or full (`model.layers.0.mlp.up_proj.mcg`).
    """
    suffixes = {name.rsplit(".", 1)[-1] for name in tensor_names}
    found = [name for name in ("mcg", "mul1") if name in suffixes]
    if len(found) > 1:
        raise InputError("both the mcg and the mul1 codebook markers are stored for one Linear")
    return found[0] if found else "3inst"


def trellis_bits(trellis: torch.Tensor) -> Bits:
    """Bits per weight K of a trellis from its shape: shape[-1] / 16, an int for K in 1..8.

    Half-integer rates 1.5, 2.5 and 3.5 (16*KA + 8 words, exllamav3 1.5 and later, mul1 only) come back as
    a float. Anything else raises InputError.
    """
    if trellis.dim() != 3 or trellis.dtype != torch.int16:
        raise InputError(
            f"trellis is {str(trellis.dtype).removeprefix('torch.')} {list(trellis.shape)}, "
            "not a 3-D int16 tensor (in/16, out/16, 16·K)"
        )
    bits = bits_of_width(trellis.shape[-1])
    if bits is not None:
        return bits
    words = trellis.shape[-1]
    raise InputError(
        f"trellis width {words} words is no EXL3 bitrate: expected 16·K words for K in 1..8 "
        "(or 24, 40, 56 for the half-integer K 1.5, 2.5, 3.5)"
    )


def tensor_core_perm() -> torch.Tensor:
    """perm[p] = the row-major tile element (r*16 + c) that sequence position p holds (int64, 256)."""
    return _tensor_core_perm().clone()


@functools.cache
def _tensor_core_perm() -> torch.Tensor:
    perm = torch.empty(256, dtype=torch.int64)
    for lane in range(32):
        r0, c0 = (lane % 4) * 2, lane // 4
        rows = (r0, r0 + 1, r0 + 8, r0 + 9)
        for j in range(8):
            perm[lane * 8 + j] = rows[j % 4] * 16 + c0 + (8 if j >= 4 else 0)
    return perm


@functools.cache
def _window_ends(bits: Bits) -> tuple[int, ...]:
    """Ring bit (exclusive) at which the 16-bit state window of each sequence position ends."""
    if isinstance(bits, int):
        return tuple((t + 1) * bits for t in range(256))
    base = int(bits)
    ends, total = [], 0
    for t in range(256):
        total += base + ((0xAAAA >> (t % 16)) & 1)
        ends.append(total)
    return tuple(ends)


@functools.cache
def _window_indices(bits: Bits, order: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Per output slot: the stream word where its window starts, and the right shift that extracts it.

    A window of 16 bits starting at bit o (0..15) of MSB-first stream word j lies in bits o..o+15 of the
    32-bit pair (word j, word j+1) and never reaches that pair's last bit, so the 31-bit value
    (word j << 15) | (word j+1 >> 1) holds it at shift 15 - o. The slots come in `order`: "sequence"
    (position t), "rows" (tile element r*16 + c, which sequence position perm^-1[r*16 + c] holds) or
    "columns" (tile element c*16 + r), so that decoding lands directly in the layout wanted.
    """
    words = round(16 * bits)
    ends = torch.tensor(_window_ends(bits), dtype=torch.int64)
    if order != "sequence":
        position = torch.argsort(_tensor_core_perm())  # position[r*16 + c]
        if order == "columns":
            position = position.view(TILE, TILE).t().reshape(-1)
        ends = ends[position]
    start = (ends - 16) % (16 * words)
    return start // 16, (15 - start % 16).to(torch.int32)


def _states(words: torch.Tensor, bits: Bits, order: str) -> torch.Tensor:
    """16-bit states (int32, (tiles, 256)) of tiles given as int16 words (tiles, 16*K)."""
    first, shift = _window_indices(bits, order)
    tiles, count = words.shape
    unsigned = words.to(torch.int32) & 0xFFFF
    # MSB-first stream words: undo SWAP16 (stored pair (a, b) is stream pair (b, a)); then the ring's
    # first word again at the end, so that every word has its successor.
    stream = unsigned.view(tiles, count // 2, 2).flip(2).reshape(tiles, count)
    ring = torch.cat([stream, stream[:, :1]], dim=1)
    pairs = ring[:, :-1] << 15
    pairs |= ring[:, 1:] >> 1
    states = torch.gather(pairs, 1, first.expand(tiles, 256))
    states >>= shift
    states &= 0xFFFF
    return states


def unpack_states(trellis: torch.Tensor) -> torch.Tensor:
    """The 16-bit tail-biting state of every sequence position: int32 (in/16, out/16, 256), values 0..65535.

    Sequence order, as exllamav3's `unpack_trellis` returns them (before `tensor_core_perm`).
    """
    bits = trellis_bits(trellis)
    rows, cols, words = trellis.shape
    flat = trellis.reshape(rows * cols, words)
    return _states(flat, bits, "sequence").view(rows, cols, 256)


def _check_codebook(name: str) -> None:
    if name not in CODEBOOKS:
        raise InputError(f"unknown EXL3 codebook {name!r}: expected one of {', '.join(CODEBOOKS)}")


def _decode_tiles(
    trellis: torch.Tensor, codebook: str, table: torch.Tensor, tiles: torch.Tensor, order: str
) -> None:
    """Write the codebook value of every element into `tiles`, a (in/16, out/16, 16, 16) view of the output.

    `order` "rows": tiles[i, j, r, c] is element (r, c) of tile (i, j); "columns": tiles[i, j, c, r].
    Works through the trellis in blocks of tile rows, vectorised over all tiles of a block.
    """
    _check_codebook(codebook)
    bits = trellis_bits(trellis)
    if isinstance(bits, float) and codebook != "mul1":
        raise InputError(f"half-integer bitrate {bits} with the {codebook} codebook: exllamav3 needs mul1")
    tiles_in, tiles_out, words = trellis.shape
    step = max(1, _CHUNK_TILES // max(tiles_out, 1))
    for first in range(0, tiles_in, step):
        block = trellis[first : first + step].reshape(-1, words)
        values = table.index_select(0, _states(block, bits, order).view(-1))
        tiles[first : first + step].copy_(values.view(-1, tiles_out, TILE, TILE))


def decode_w_hat(trellis: torch.Tensor, codebook: str) -> torch.Tensor:
    """W_hat, the rotated-basis weight exllamav3's `reconstruct` writes: fp16 (in_padded, out_padded).

    Bit-exact: every value is the codebook entry of its tile's tail-biting state at that element.
    """
    trellis_bits(trellis)
    _check_codebook(codebook)
    tiles_in, tiles_out = trellis.shape[:2]
    w_hat = torch.empty((tiles_in * TILE, tiles_out * TILE), dtype=torch.float16)
    # Element (r, c) of tile (i, j) is W_hat[16i + r, 16j + c].
    tiles = w_hat.view(tiles_in, TILE, tiles_out, TILE).permute(0, 2, 1, 3)
    _decode_tiles(trellis, codebook, _table(codebook), tiles, "rows")
    return w_hat


@functools.cache
def _float_table(name: str) -> torch.Tensor:
    return _table(name).to(torch.float32)


def _sign_scales(vector: torch.Tensor, name: str, packed_name: str, length: int, side: str) -> torch.Tensor:
    """float32 (length,) from an fp16 sign-and-scale vector or an int16 sign bitfield."""
    if vector.dim() != 1 or vector.dtype not in (torch.float16, torch.int16):
        raise InputError(
            f"{name}/{packed_name} is {str(vector.dtype).removeprefix('torch.')} {list(vector.shape)}: "
            f"expected {name} float16 ({length},) or {packed_name} int16 ({length // 16},)"
        )
    if vector.dtype == torch.float16:
        if vector.numel() != length:
            raise InputError(
                f"{name} has {vector.numel()} elements, expected {length} "
                f"({side} padded to a multiple of 128)"
            )
        return vector.to(torch.float32)
    if vector.numel() * 16 != length:
        raise InputError(
            f"{packed_name} has {vector.numel()} words, expected {length // 16} "
            f"(one bit per {side}, padded to a multiple of 128)"
        )
    words = vector.to(torch.int32) & 0xFFFF
    set_bits = (words[:, None] >> torch.arange(16, dtype=torch.int32)) & 1
    return (1 - 2 * set_bits).to(torch.float32).reshape(-1)


@functools.cache
def _hadamard() -> torch.Tensor:
    """The 128-point Sylvester matrix, unscaled ±1, float32."""
    h = torch.ones(1, 1)
    while h.shape[0] < HADAMARD_SIZE:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def decode_weight(
    trellis: torch.Tensor,
    suh_or_su: torch.Tensor,
    svh_or_sv: torch.Tensor,
    codebook: str,
    in_features: int,
    out_features: int,
) -> torch.Tensor:
    """The dense weight of one EXL3 Linear in the HF orientation: float32 (out_features, in_features).

    `suh_or_su` / `svh_or_sv` are the stored fp16 `suh` / `svh` or the older int16 `su` / `sv`, of the
    padded lengths; `in_features` / `out_features` are the HF weight's (unpadded) dimensions. Returns
    W[:in, :out].T for W = diag(suh) · H · W_hat · H · diag(svh), computed in float32 directly in the
    transposed orientation, H applied as matrix products on 128-wide blocks of reshaped views. Memory: the
    result plus two buffers of about 4 MB.
    """
    trellis_bits(trellis)  # a trellis of no EXL3 shape is named before the feature counts are compared
    in_padded, out_padded = padded(in_features), padded(out_features)
    want = (in_padded // TILE, out_padded // TILE)
    if in_features < 1 or out_features < 1 or tuple(trellis.shape[:2]) != want:
        raise InputError(
            f"trellis {list(trellis.shape)} does not tile a weight of in_features={in_features}, "
            f"out_features={out_features} padded to multiples of 128: expected [{want[0]}, {want[1]}, 16·K]"
        )
    su = _sign_scales(suh_or_su, "suh", "su", in_padded, "input feature")
    sv = _sign_scales(svh_or_sv, "svh", "sv", out_padded, "output feature")
    _check_codebook(codebook)
    table = _float_table(codebook)
    h = _hadamard()
    # W^T = diag(svh) · H · W_hat^T · H · diag(suh), built in blocks of whole 128-row Hadamard blocks of
    # output features, so that the work buffers stay small and only the result is weight-sized.
    rows = HADAMARD_SIZE * max(1, BLOCK_ELEMENTS // (HADAMARD_SIZE * in_padded))
    block = torch.empty((rows, in_padded), dtype=torch.float32)
    rotated = torch.empty_like(block)
    result = torch.empty((out_features, in_features), dtype=torch.float32)
    for first in range(0, out_padded, rows):
        count = min(rows, out_padded - first)
        decoded, turned = block[:count], rotated[:count]
        # W_hat^T rows: element (r, c) of tile (i, j) is W_hat^T[16j + c, 16i + r].
        tiles = decoded.view(count // TILE, TILE, want[0], TILE).permute(2, 0, 1, 3)
        _decode_tiles(trellis[:, first // TILE : (first + count) // TILE], codebook, table, tiles, "columns")
        # · H: each row's 128-wide blocks times H (symmetric), one matrix product on a reshaped view.
        torch.matmul(decoded.view(-1, HADAMARD_SIZE), h, out=turned.view(-1, HADAMARD_SIZE))
        # diag(svh) · H · (...) per 128-row block, svh and both 1/sqrt(128) folded into the block's left
        # factor (1/128 is a power of two: exact); then · diag(suh).
        left = sv[first : first + count].view(-1, HADAMARD_SIZE, 1) * (h * (1.0 / HADAMARD_SIZE))
        torch.matmul(
            left, turned.view(-1, HADAMARD_SIZE, in_padded), out=decoded.view(-1, HADAMARD_SIZE, in_padded)
        )
        decoded *= su
        kept = min(count, out_features - first)
        if kept > 0:
            result[first : first + kept] = decoded[:kept, :in_features]
    return result


def rotated_tile_errors(
    error: torch.Tensor, suh_or_su: torch.Tensor, svh_or_sv: torch.Tensor, in_features: int
) -> torch.Tensor:
    """The mean squared error of every 16×16 tile of W_hat (exllamav3's rotated basis), from an error of the
    dense weight: `error` float32 (rows, in_features), HF orientation, the rows a block of output features
    whose sign vector is `svh_or_sv` (padded to a multiple of 128 rows); `suh_or_su` for all input features.

    The inverse of `decode_weight`'s rotation: E_hat = H · diag(1/suh) · E · diag(1/svh) · H / 128, with
    1/s taken as 0 where a sign-and-scale is 0 (a feature the decode always zeroes, so its error is no
    tile's). A corrupted tile of the trellis changes only its own 256 values of W_hat, while in the dense
    weight it spreads over a whole 128×128 block; quantization noise is about equal across tiles there, by
    the rotation's design. Returns float32 (out_tiles, in_tiles) in the transposed (output-first) layout,
    NaN for a tile all of whose rows or columns are zeroed.
    """
    rows = svh_or_sv.numel() * (16 if svh_or_sv.dtype == torch.int16 else 1)
    in_p = padded(in_features)
    su = _sign_scales(suh_or_su, "suh", "su", in_p, "input feature")
    sv = _sign_scales(svh_or_sv, "svh", "sv", rows, "output feature")
    if rows % HADAMARD_SIZE or error.shape[0] > rows or error.shape[1] != in_features:
        raise InputError(f"an error block of {list(error.shape)} does not fit {rows} padded output features")
    inv_su = torch.where(su != 0, 1.0 / su, torch.zeros_like(su))
    inv_sv = torch.where(sv != 0, 1.0 / sv, torch.zeros_like(sv))
    scaled = torch.zeros((rows, in_p), dtype=torch.float32)
    scaled[: error.shape[0], :in_features] = error
    scaled *= inv_su
    scaled *= inv_sv[:, None]
    h = _hadamard()
    turned = (scaled.view(-1, HADAMARD_SIZE) @ h).view(rows, in_p)
    rotated = torch.matmul(h, turned.view(-1, HADAMARD_SIZE, in_p)).view(rows, in_p) * (1.0 / HADAMARD_SIZE)
    mse = rotated.square().view(rows // TILE, TILE, in_p // TILE, TILE).mean(dim=(1, 3))
    live_rows = (inv_sv != 0).view(-1, TILE).any(dim=1)
    live_cols = (inv_su != 0).view(-1, TILE).any(dim=1)
    mse[~(live_rows[:, None] & live_cols[None, :])] = float("nan")
    return mse
