"""An EXL3 encoder for test fixtures: an HF weight in, the tensors exllamav3 stores for one Linear out.

exllamav3's own encoder is a CUDA Viterbi search over the full trellis (65,536 states per step) after LDLQ
with a calibration Hessian; this one runs on CPUs in minutes for a 135M-parameter model, so it trades some
accuracy for speed and uses no calibration data. What it writes is valid, tail-biting EXL3 that exllamav3
and `evalsuite.formats.exl3_decode` decode alike (any int16 trellis is valid; the search only decides how
close the decoded weight comes to the source). The layout is written here from the format's definition and
shares nothing with the decoder but the codebook tables (`codebook_table`).

The steps, after exllamav3's `modules/quant/exl3_lib/quantize.py` (`quantize_exl3`, `regularize`, `ldlq`
without its Hessian, `pack_trellis`) and `modules/linear.py` (`pad_to = 128`):

1. W (in, out) = the HF weight transposed, zero-padded to multiples of 128 in both dimensions.
2. Random signs for input and output features from a seeded `torch.Generator` (deterministic); output
   channels scaled to a mean RMS of one; W · diag(1/sv) · H, then diag(1/su) with su the signs times each
   row's RMS over the codebook's RMS, then H · (...), H the block-diagonal 128-point Sylvester Hadamard
   scaled by 1/sqrt(128). Features of a 128-block that is partly padding are amplified so that the block
   rotates to the same RMS as a full one. A global scale g, chosen by encoding a sample of tiles at a few
   candidate scales, is folded into su. All-zero rows and columns (padding included) get a zero
   sign-and-scale, so they decode to exact zeros.
3. The rotated W is cut into 16x16 tiles laid out (in/16, out/16); each tile's elements are taken in the
   order of exllamav3's `tensor_core_perm` (sequence position p holds row-major element perm[p]).
4. Per tile, a reduced-state trellis search chooses the 256 16-bit states, s_t = ((s_{t-1} << K) | sym_t)
   & 0xffff, minimising the squared error of codebook(s_t) against the targets. It keeps, for each value of
   the last g bits of the state (g chosen so that 2^g * 2^K candidates are tried per step, `effort`), the
   best path reaching it: Viterbi over 2^g classes of states instead of exllamav3's full 2^(16 - K). All
   tiles of a block are searched together (a loop over the 256 positions, vectorised across tiles).
   Tail-biting: a short first pass over the last positions of the tile and the first of the next lap picks
   the ring's final 16 - K bits w; the main pass starts from the state w and forces the symbols that end the
   ring to spell w, choosing its last free symbol with the exact cost of the forced ones ahead. The states
   then decode around the ring exactly as searched.
5. The low K bits of each state, MSB first, make the tile's 256*K-bit stream; it is stored in 16*K int16
   words with the two uint16 halves of every 32-bit word swapped (`SWAP16` in exllamav3's `pack.cu`).
6. suh = su, svh = sv as float16 (scales folded in, as exllamav3 stores them, with the padded lengths);
   the `mcg` or `mul1` codebooks add their marker, an int32 scalar holding the multiplier's bits.
"""

from __future__ import annotations

import functools
import math

import torch

from evalsuite.errors import InputError
from evalsuite.formats.exl3_decode import codebook_table

__all__ = ["CODEBOOK_MARKERS", "encode_weight", "pack_states", "trellis_search"]

# The marker tensor of each non-default codebook: exllamav3 stores the multiplier's 32 bits as int32.
CODEBOOK_MARKERS = {"mcg": 0xCBAC1FED, "mul1": 0x83DCD12D}
_PAD = 128
_TILE = 16
# A cost no path reaches: finite, so that sums stay ordered.
_FORBIDDEN = 1.0e30
# Low bits of a float32 cost that the search overwrites with the index of the candidate (at most 2^8).
_INDEX_BITS = 0xFF
# Bounds of a block of tiles searched together: candidates per step (floats), back pointers (bytes).
_BLOCK_CANDIDATES = 1 << 20
_BLOCK_BACK_POINTERS = 1 << 25
# The rotated weight's RMS relative to the codebook's that suits each K best on Gaussian data (measured with
# this search: fewer bits want a coarser fit of the tails); each encode tries it and its neighbours on a
# sample of tiles.
_SCALE_PRIOR = {1: 1.1, 2: 0.975, 3: 0.9, 4: 0.825, 5: 0.775, 6: 0.7, 7: 0.65, 8: 0.6}
_SCALE_STEPS = (0.92, 1.0, 1.08)
_SCALE_SAMPLE_TILES = 64
# Positions of the first (wrap-finding) pass: before the end of the ring and after it.
_WARMUP_BEFORE = 32
_WARMUP_AFTER = 8


def _sequence_order() -> torch.Tensor:
    """Row-major tile element held by each sequence position (exllamav3's `tensor_core_perm`).

    Position p = 32*c0 + 8*t4 + 4*ch + 2*rh + rl holds element (r, c) = (8*rh + 2*t4 + rl, 8*ch + c0): lane
    t = 4*c0 + t4 of the tensor-core fragment holds rows 2*t4 (+1, +8, +9) of columns c0 and c0 + 8.
    """
    p = torch.arange(256)
    c0, t4, ch, rh, rl = p // 32, (p // 8) % 4, (p // 4) % 2, (p // 2) % 2, p % 2
    return (8 * rh + 2 * t4 + rl) * _TILE + 8 * ch + c0


@functools.cache
def _sylvester() -> torch.Tensor:
    """The 128-point Sylvester Hadamard matrix scaled by 1/sqrt(128), as a Kronecker power of H2."""
    h2 = torch.tensor([[1.0, 1.0], [1.0, -1.0]])
    h = torch.ones(1, 1)
    for _ in range(int(math.log2(_PAD))):
        h = torch.kron(h, h2)
    return h / math.sqrt(_PAD)


def _check(weight: torch.Tensor, bits: int, codebook: str) -> None:
    if weight.dim() != 2 or not weight.is_floating_point():
        raise InputError(f"weight is {weight.dtype} {list(weight.shape)}, not a 2-D floating-point tensor")
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 8:
        raise InputError(f"bits per weight {bits!r} is not an integer K in 1..8")
    if codebook not in ("3inst", *CODEBOOK_MARKERS):
        raise InputError(f"unknown EXL3 codebook {codebook!r}: expected one of 3inst, mcg, mul1")


def _rms(x: torch.Tensor, dim: int) -> torch.Tensor:
    return x.square().mean(dim=dim).sqrt()


def _block_fill(live: torch.Tensor) -> torch.Tensor:
    """Per feature, sqrt(128 / live features of its 128-block) (1 in an empty block).

    The Hadamard rotation spreads a block's live rows (or columns) over all 128 of them; a block that is
    partly padding would come out weaker than a full one and be quantized more coarsely, so its live
    features are amplified by this factor first (and the sign-and-scale vectors divide it out again).
    """
    count = live.view(-1, _PAD).sum(dim=1, keepdim=True).clamp(min=1)
    return (_PAD / count).sqrt().expand(-1, _PAD).reshape(-1)


def _random_signs(count: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 2, (count,), generator=generator).to(torch.float32) * 2 - 1


def _search_pass(
    targets: torch.Tensor, values: torch.Tensor, bits: int, classes: int, start: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reduced-state Viterbi over `targets` (tiles, steps) with no constraint at the end.

    `start`: the state before the first step for every tile (None: any; the classes start from distinct
    states). Returns the cost (tiles, classes) and state (tiles, classes) of the best path into each class,
    and the back pointers (steps, tiles, classes) uint8: the candidate index `a` in the step's (2^K, classes)
    view, from which the predecessor class is (a*classes + class) >> K and the symbol its low K bits.
    """
    tiles, steps = targets.shape
    width = 1 << bits
    keep = (1 << (16 - bits)) - 1
    rows = values.view(-1, width)  # rows[s & keep] = the values of the 2^K successors of state s
    if start is None:
        states = torch.arange(classes, dtype=torch.int64).repeat(tiles, 1)
        cost = torch.zeros(tiles, classes)
    else:
        # Every class holds the start state; only the class of its last bits is open.
        states = start[:, None].repeat(1, classes)
        cost = torch.full((tiles, classes), _FORBIDDEN)
        cost.scatter_(1, (start % classes)[:, None], 0.0)
    index_pattern = torch.arange(width, dtype=torch.int32).view(1, width, 1)
    class_index = torch.arange(classes)
    back = torch.empty(steps, tiles, classes, dtype=torch.uint8)
    buffer = torch.empty(tiles * classes, width)
    for t in range(steps):
        torch.index_select(rows, 0, (states & keep).view(-1), out=buffer)
        candidates = buffer.view(tiles, classes, width)
        candidates -= targets[:, t, None, None]
        candidates.square_()
        candidates += cost[:, :, None]
        # Viewed as (2^K, classes), column j holds the 2^K candidates whose state ends in class j's bits.
        # The candidate's index goes into the low bits of its cost (a non-negative float, so its bits order
        # as integers do), and one minimum over the 2^K rows gives each column's best cost and index.
        keys = buffer.view(torch.int32).view(tiles, width, classes)
        keys &= ~_INDEX_BITS
        keys |= index_pattern
        half = width
        while half > 1:
            half //= 2
            torch.minimum(keys[:, :half], keys[:, half : 2 * half], out=keys[:, :half])
        keys = keys[:, 0]
        choice = keys & _INDEX_BITS
        cost = (keys & ~_INDEX_BITS).view(torch.float32)
        flat = choice.to(torch.int64) * classes + class_index
        states = ((states.gather(1, flat >> bits) << bits) | (flat & (width - 1))) & 0xFFFF
        back[t] = choice
    return cost, states, back


def _trace_back(back: torch.Tensor, bits: int, final_class: torch.Tensor) -> torch.Tensor:
    """Symbols (tiles, steps) of the path that ends in `final_class` (tiles,)."""
    steps, tiles, classes = back.shape
    symbols = torch.empty(tiles, steps, dtype=torch.int64)
    tile_index = torch.arange(tiles)
    current = final_class
    for t in range(steps - 1, -1, -1):
        flat = back[t, tile_index, current].to(torch.int64) * classes + current
        symbols[:, t] = flat & ((1 << bits) - 1)
        current = flat >> bits
    return symbols


def _classes(bits: int, effort: int) -> int:
    """Classes of states the search keeps: effort / 2^K, rounded to a power of two, at least 1."""
    return max(1, 2 ** round(math.log2(max(effort, 1 << bits))) >> bits)


def _block_tiles(bits: int, effort: int) -> int:
    classes = _classes(bits, effort)
    return max(1, min(_BLOCK_CANDIDATES // (classes << bits), _BLOCK_BACK_POINTERS // (256 * classes)))


def _forced_bits(bits: int) -> list[int]:
    """How many low bits of each position's symbol the ring's last 16 - K bits fix (0 for most)."""
    return [max(0, min(bits, (16 - bits) - (255 - p) * bits)) for p in range(256)]


def trellis_search(targets: torch.Tensor, bits: int, codebook: str, effort: int = 512) -> torch.Tensor:
    """Tail-biting states (tiles, 256) int64 whose codebook values approximate `targets` (tiles, 256).

    Targets are in sequence order. `effort` is the number of candidates tried per step and tile (rounded
    to a power of two, at least 2^K): the search keeps effort / 2^K classes of states.
    """
    values = codebook_table(codebook).to(torch.float32)
    width = 1 << bits
    classes = _classes(bits, effort)
    keep = (1 << (16 - bits)) - 1
    tiles = targets.shape[0]
    targets = targets.to(torch.float32)

    # Pass 1: the ring's last 16 - K bits, from a path over its end and the start of the next lap.
    lap = torch.cat([targets[:, 256 - _WARMUP_BEFORE :], targets[:, :_WARMUP_AFTER]], dim=1)
    cost, _, back = _search_pass(lap, values, bits, classes, None)
    symbols = _trace_back(back, bits, cost.argmin(dim=1))
    ring_end = torch.zeros(tiles, dtype=torch.int64)
    for t in range(_WARMUP_BEFORE):
        ring_end = ((ring_end << bits) | symbols[:, t]) & 0xFFFF
    wrap = ring_end & keep

    # Pass 2: from the state `wrap` around the ring; the last symbols must spell `wrap` again.
    forced = _forced_bits(bits)
    last_free = max(p for p in range(256) if forced[p] < bits)
    cost, states, back = _search_pass(targets[:, :last_free], values, bits, classes, wrap)
    # The last free position: every candidate, plus the exact cost of the forced positions after it.
    candidates = ((states << bits) & 0xFFFF)[:, :, None] | torch.arange(width)
    total = cost[:, :, None] + (values[candidates] - targets[:, last_free, None, None]).square()
    if forced[last_free]:
        mask = (1 << forced[last_free]) - 1
        want = (wrap >> ((255 - last_free) * bits)) & mask
        total.masked_fill_((torch.arange(width) & mask) != want[:, None, None], _FORBIDDEN)
    following = candidates
    for p in range(last_free + 1, 256):
        symbol = (wrap >> ((255 - p) * bits)) & (width - 1)
        following = ((following << bits) | symbol[:, None, None]) & 0xFFFF
        total += (values[following] - targets[:, p, None, None]).square()
    best = total.view(tiles, -1).argmin(dim=1)
    final_class, last_symbol = best >> bits, best & (width - 1)
    symbols = torch.empty(tiles, 256, dtype=torch.int64)
    if last_free:
        symbols[:, :last_free] = _trace_back(back, bits, final_class)
    symbols[:, last_free] = last_symbol
    for p in range(last_free + 1, 256):
        symbols[:, p] = (wrap >> ((255 - p) * bits)) & (width - 1)

    states = torch.empty(tiles, 256, dtype=torch.int64)
    state = wrap
    for t in range(256):
        state = ((state << bits) | symbols[:, t]) & 0xFFFF
        states[:, t] = state
    return states


def pack_states(states: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack tail-biting states (..., 256) into EXL3 trellis words: int16 (..., 16*K).

    Each state's low K bits, most significant first, are appended to the tile's bitstream; the stream is
    cut into uint16 words, and the two words of every pair are swapped (exllamav3's SWAP16).
    """
    lead = states.shape[:-1]
    symbols = states.reshape(-1, 256).to(torch.int64) & ((1 << bits) - 1)
    shifts = torch.arange(bits - 1, -1, -1)
    stream = ((symbols[:, :, None] >> shifts) & 1).reshape(-1, 16 * bits, 16)
    words = (stream << torch.arange(15, -1, -1)).sum(dim=2)
    words = words.view(-1, 8 * bits, 2).flip(2).reshape(-1, 16 * bits)
    signed = torch.where(words >= 0x8000, words - 0x10000, words).to(torch.int16)
    return signed.reshape(*lead, 16 * bits)


def _choose_scale(tiles: torch.Tensor, bits: int, codebook: str, effort: int) -> tuple[float, torch.Tensor]:
    """The candidate scale whose search on a sample of tiles gives the least error in weight units.

    Also returns the sample's states at that scale: the whole encoding when the sample is every tile.
    """
    count = tiles.shape[0]
    sample = tiles[torch.linspace(0, count - 1, min(count, _SCALE_SAMPLE_TILES)).round().long()]
    grid = [_SCALE_PRIOR[bits] * step for step in _SCALE_STEPS]
    scales = torch.tensor(grid).repeat_interleave(sample.shape[0])[:, None]
    trial = sample.repeat(len(grid), 1)
    states = trellis_search(trial * scales, bits, codebook, effort)
    values = codebook_table(codebook).to(torch.float32)
    errors = (values[states] / scales - trial).square().view(len(grid), -1).mean(dim=1)
    best = int(errors.argmin())
    return grid[best], states.view(len(grid), -1, 256)[best]


def encode_weight(
    weight: torch.Tensor, bits: int, codebook: str = "3inst", *, seed: int = 0, effort: int = 512
) -> dict[str, torch.Tensor]:
    """The EXL3 tensors of one Linear whose HF weight is `weight` (out_features, in_features).

    Returns {"trellis": int16 (in_p/16, out_p/16, 16*K), "suh": float16 (in_p,), "svh": float16 (out_p,)}
    with in_p, out_p the feature counts padded to multiples of 128, plus {"mcg"} or {"mul1"}: an int32
    scalar marker for those codebooks. Deterministic for a given `seed` (the sign vectors').
    """
    _check(weight, bits, codebook)
    out_features, in_features = weight.shape
    in_p, out_p = -(-in_features // _PAD) * _PAD, -(-out_features // _PAD) * _PAD
    generator = torch.Generator().manual_seed(seed)
    su = _random_signs(in_p, generator)
    sv = _random_signs(out_p, generator)
    h = _sylvester()

    w = torch.zeros(in_p, out_p)
    w[:in_features, :out_features] = weight.detach().t().to(torch.float32)
    column_rms = _rms(w, 0)
    live_columns = column_rms > 0
    if live_columns.any():
        scale = column_rms / column_rms[live_columns].mean() / _block_fill(live_columns)
        sv = sv * torch.where(live_columns, scale, 1.0)
    w /= sv
    w = (w.view(-1, _PAD) @ h).view(in_p, out_p)
    row_rms = _rms(w, 1)
    live_rows = row_rms > 0
    codebook_rms = _rms(codebook_table(codebook).to(torch.float32), 0).item()
    su = su * torch.where(live_rows, row_rms / codebook_rms / _block_fill(live_rows), 1.0)
    w /= su[:, None]
    w = (h @ w.view(-1, _PAD, out_p)).view(in_p, out_p)

    order = _sequence_order()
    tiles_in, tiles_out = in_p // _TILE, out_p // _TILE
    tiles = w.view(tiles_in, _TILE, tiles_out, _TILE).permute(0, 2, 1, 3).reshape(-1, 256)[:, order]
    del w
    scale, states = _choose_scale(tiles, bits, codebook, effort)
    su /= scale
    if states.shape[0] < tiles.shape[0]:  # else the sample was every tile, and is encoded already
        states = torch.empty(tiles.shape[0], 256, dtype=torch.int64)
        step = _block_tiles(bits, effort)
        for first in range(0, tiles.shape[0], step):
            states[first : first + step] = trellis_search(
                tiles[first : first + step] * scale, bits, codebook, effort
            )

    su[~live_rows] = 0.0
    sv[~live_columns] = 0.0
    tensors = {
        "trellis": pack_states(states.view(tiles_in, tiles_out, 256), bits),
        "suh": su.to(torch.float16),
        "svh": sv.to(torch.float16),
    }
    if codebook in CODEBOOK_MARKERS:
        multiplier = CODEBOOK_MARKERS[codebook]
        tensors[codebook] = torch.tensor(multiplier - (1 << 32) if multiplier >= 1 << 31 else multiplier).to(
            torch.int32
        )
    return tensors
