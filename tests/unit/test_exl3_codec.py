"""The EXL3 trellis codec: the CPU decoder against the format's definition worked out here by hand, and the
fixture encoder against the decoder.

Independent references written in this file: codebook values by plain integer arithmetic and numpy fp16, a
packer and the state windows by bit lists, `tensor_core_perm` as exllamav3's quantize.py spells it, and the
dense weight as explicit float64 matrix products. When `tests/data/exl3_golden.safetensors` (written on a
CUDA machine by `bench/exl3_gpu_check.sh`) exists, W_hat is also checked bit for bit against exllamav3's own.
"""

from __future__ import annotations

import functools
import json
import math
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from evalsuite.errors import InputError
from evalsuite.fixtures.exl3_encoder import encode_weight, pack_states, trellis_search
from evalsuite.formats import exl3_decode
from evalsuite.formats.exl3_decode import (
    codebook_of,
    codebook_table,
    decode_w_hat,
    decode_weight,
    tensor_core_perm,
    trellis_bits,
    unpack_states,
)

GOLDEN = Path(__file__).resolve().parents[1] / "data" / "exl3_golden.safetensors"

# Measured with this encoder (seeded, so every run gives these values): the relative Frobenius error of the
# decoded weight against a N(0, 0.02^2) source at K = 4 is 0.092 for 256x384 and 0.0925 for 192x576 (3INST).
# For scale: the same search keeping 8 times more classes of states (256, closer to exllamav3's full
# Viterbi) reaches about 0.072, and round-to-nearest INT4 with a per-row absmax scale 0.132. A wrong
# layout gives about 1.4.
K4_BOUND = 0.1


# ----------------------------------------------------------------------------------------------------------
# References written from the format's definition
# ----------------------------------------------------------------------------------------------------------


def fp16_bits_to_float(bits: int) -> np.float32:
    return np.float32(np.frombuffer(struct.pack("<H", bits), dtype=np.float16)[0])


def fp16_bits(value: np.float32) -> int:
    return int(np.float16(value).view(np.uint16))


def reference_value_bits(codebook: str, state: int) -> int:
    """codebook.cuh's decode_3inst<cb>(state) as an fp16 bit pattern, in Python integers and numpy."""
    if codebook == "mul1":
        x = (state * 0x83DCD12D) % 2**32
        h = fp16_bits_to_float(0x6400 + sum(x.to_bytes(4, "little")))
        return fp16_bits(h * fp16_bits_to_float(0x1EEE) + fp16_bits_to_float(0xC931))
    x = (state * 89226354 + 64248484) % 2**32 if codebook == "3inst" else (state * 0xCBAC1FED) % 2**32
    x = (x & 0x8FFF8FFF) ^ 0x3B603B60
    return fp16_bits(fp16_bits_to_float(x & 0xFFFF) + fp16_bits_to_float(x >> 16))


def window_ends(bits: float) -> list[int]:
    """Ring bit where the state window of each sequence position ends (half-integer K: widths KA, KA+1)."""
    if float(bits).is_integer():
        return [(t + 1) * int(bits) for t in range(256)]
    widths = [int(bits) + ((0xAAAA >> (t % 16)) & 1) for t in range(256)]
    return list(np.cumsum(widths))


def reference_pack(symbols: list[int], bits: float) -> list[int]:
    """One tile: symbols (each its position's width in bits) -> int16 words, from the definition."""
    stream: list[int] = []
    previous = 0
    for end, symbol in zip(window_ends(bits), symbols, strict=True):
        width = end - previous
        previous = end
        stream += [(symbol >> (width - 1 - b)) & 1 for b in range(width)]
    words = [int("".join(map(str, stream[i : i + 16])), 2) for i in range(0, len(stream), 16)]
    swapped = [w for pair in zip(words[1::2], words[0::2], strict=True) for w in pair]  # SWAP16
    return [w - 0x10000 if w >= 0x8000 else w for w in swapped]


def reference_states(symbols: list[int], bits: float) -> list[int]:
    """The 16-bit window of the ring that ends at each position's last bit."""
    stream: list[int] = []
    previous = 0
    ends = window_ends(bits)
    for end, symbol in zip(ends, symbols, strict=True):
        width = end - previous
        previous = end
        stream += [(symbol >> (width - 1 - b)) & 1 for b in range(width)]
    ring = len(stream)
    return [int("".join(str(stream[(b % ring)]) for b in range(end - 16, end)), 2) for end in ends]


def reference_perm() -> list[int]:
    """exllamav3's quantize.py tensor_core_perm, written out as it does."""
    perm = [0] * 256
    for t in range(32):
        r0 = (t % 4) * 2
        r1, r2, r3 = r0 + 1, r0 + 8, r0 + 9
        c0 = t // 4
        c1 = c0 + 8
        for j, (r, c) in enumerate(
            [(r0, c0), (r1, c0), (r2, c0), (r3, c0), (r0, c1), (r1, c1), (r2, c1), (r3, c1)]
        ):
            perm[t * 8 + j] = r * 16 + c
    return perm


def sylvester_128() -> torch.Tensor:
    h = torch.tensor([[1.0]], dtype=torch.float64)
    while h.shape[0] < 128:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(128)


def random_trellis(seed: int, tiles_in: int, tiles_out: int, words: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(
        -(2**15), 2**15, (tiles_in, tiles_out, words), generator=generator, dtype=torch.int16
    )


def relative_error(decoded: torch.Tensor, source: torch.Tensor) -> float:
    return ((decoded - source.float()).norm() / source.float().norm()).item()


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One torch thread: the search's many small steps wait on each other's threads on a loaded machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@functools.cache
def source_weight(out_features: int, in_features: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(out_features * 7 + in_features)
    return torch.randn(out_features, in_features, generator=generator) * 0.02


@functools.cache
def encoded(
    out_features: int, in_features: int, bits: int, codebook: str = "3inst"
) -> dict[str, torch.Tensor]:
    return encode_weight(source_weight(out_features, in_features), bits, codebook, seed=5)


def decoded_from(tensors: dict[str, torch.Tensor], out_features: int, in_features: int) -> torch.Tensor:
    return decode_weight(
        tensors["trellis"], tensors["suh"], tensors["svh"], codebook_of(tensors), in_features, out_features
    )


# ----------------------------------------------------------------------------------------------------------
# Codebooks
# ----------------------------------------------------------------------------------------------------------


def test_3inst_table_rms_is_exllamav3_codebook_scale():
    rms = codebook_table("3inst").double().square().mean().sqrt().item()
    assert f"{rms:.7g}" == f"{1.24371088:.7g}" == "1.243711"


def test_codebook_entries_equal_bit_patterns_worked_by_hand():
    # State 0 of 3INST: 64248484 = 0x03D45AA4; masked and xored: halves 0x31C4 (0.1802) and 0x38B4 (0.588),
    # sum 0.7683 -> fp16 0x3A25. State 0 of mul1: byte sum 0, h = 1024, 1024 * 0x1eee (1774 * 2^-18)
    # + 0xc931 (-10.3828125) = -3.453125 -> fp16 0xC2E8.
    assert int(codebook_table("3inst")[0].view(torch.int16)) & 0xFFFF == 0x3A25
    assert int(codebook_table("mul1")[0].view(torch.int16)) & 0xFFFF == 0xC2E8
    for codebook in ("3inst", "mcg", "mul1"):
        table = codebook_table(codebook).view(torch.int16)
        for state in (0, 1, 2, 0x00FF, 0x1234, 0x7FFF, 0x8000, 0xBEEF, 0xFFFE, 0xFFFF):
            assert int(table[state]) & 0xFFFF == reference_value_bits(codebook, state), (codebook, state)


def test_codebook_tables_match_the_reference_on_a_spread_of_states():
    for codebook in ("3inst", "mcg", "mul1"):
        table = codebook_table(codebook).view(torch.int16)
        for state in range(0, 65536, 257):
            assert int(table[state]) & 0xFFFF == reference_value_bits(codebook, state), (codebook, state)


def test_codebook_table_is_a_copy_the_caller_may_change():
    first = codebook_table("mcg")
    first.zero_()
    assert codebook_table("mcg").abs().max() > 0


def test_codebook_is_chosen_by_marker_tensors():
    assert codebook_of(["m.q_proj.trellis", "m.q_proj.suh", "m.q_proj.svh"]) == "3inst"
    assert codebook_of(["m.q_proj.trellis", "m.q_proj.mcg"]) == "mcg"
    assert codebook_of(["trellis", "mul1", "suh", "svh"]) == "mul1"
    with pytest.raises(InputError, match="both the mcg and the mul1"):
        codebook_of(["x.mcg", "x.mul1"])


# ----------------------------------------------------------------------------------------------------------
# Bits -> states -> tiles
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 6, 7, 8, 1.5, 2.5, 3.5])
def test_packed_symbols_unpack_to_their_tail_biting_states(bits):
    generator = torch.Generator().manual_seed(round(bits * 10))
    widths = np.diff([0, *window_ends(bits)])
    tiles = []
    for _ in range(3):
        tiles.append([int(torch.randint(0, 1 << int(w), (1,), generator=generator)) for w in widths])
    trellis = torch.tensor([[reference_pack(symbols, bits) for symbols in tiles]], dtype=torch.int16)
    assert trellis.shape == (1, 3, round(16 * bits))
    states = unpack_states(trellis)
    for j, symbols in enumerate(tiles):
        assert states[0, j].tolist() == reference_states(symbols, bits)


@pytest.mark.parametrize("bits", range(1, 9))
def test_encoder_packer_writes_what_the_reference_packer_writes(bits):
    generator = torch.Generator().manual_seed(bits)
    states = torch.randint(0, 65536, (2, 256), generator=generator)
    symbols = (states & ((1 << bits) - 1)).tolist()
    packed = pack_states(states.view(1, 2, 256), bits)
    assert packed[0].tolist() == [reference_pack(row, bits) for row in symbols]
    # and the decoder reads back the states those symbols make around the ring
    assert unpack_states(packed)[0].tolist() == [reference_states(row, bits) for row in symbols]


@pytest.mark.parametrize("bits", range(1, 9))
def test_searched_states_are_the_states_their_packing_decodes_to(bits):
    # The search's path must be tail-biting: the ring's last 16 - K bits feed its first state.
    generator = torch.Generator().manual_seed(20 + bits)
    targets = torch.randn(3, 256, generator=generator)
    states = trellis_search(targets, bits, "3inst", effort=64)
    assert torch.equal(unpack_states(pack_states(states.view(1, 3, 256), bits))[0].long(), states)


def test_tensor_core_perm_is_exllamav3s():
    assert tensor_core_perm().tolist() == reference_perm()


@pytest.mark.parametrize(("bits", "codebook"), [(2, "3inst"), (3, "mcg"), (5, "mul1"), (2.5, "mul1")])
def test_w_hat_holds_each_states_codebook_value_at_its_permuted_place(bits, codebook):
    trellis = random_trellis(11, 2, 3, round(16 * bits))
    w_hat = decode_w_hat(trellis, codebook)
    assert w_hat.shape == (32, 48) and w_hat.dtype == torch.float16
    table = codebook_table(codebook)
    states = unpack_states(trellis)
    perm = reference_perm()
    expected = torch.empty(32, 48, dtype=torch.float16)
    for i in range(2):
        for j in range(3):
            for p in range(256):
                r, c = divmod(perm[p], 16)
                expected[16 * i + r, 16 * j + c] = table[states[i, j, p]]
    assert torch.equal(w_hat.view(torch.int16), expected.view(torch.int16))


def test_w_hat_is_the_same_whatever_block_size_the_decoder_works_in(monkeypatch):
    trellis = random_trellis(3, 16, 8, 48)
    whole = decode_w_hat(trellis, "3inst")
    monkeypatch.setattr(exl3_decode, "_CHUNK_TILES", 20)
    assert torch.equal(decode_w_hat(trellis, "3inst").view(torch.int16), whole.view(torch.int16))


# ----------------------------------------------------------------------------------------------------------
# Dense weight
# ----------------------------------------------------------------------------------------------------------


def test_dense_weight_is_the_rotated_w_hat_scaled_trimmed_and_transposed():
    in_features, out_features = 200, 100  # padded to 256 and 128
    trellis = random_trellis(5, 16, 8, 64)
    generator = torch.Generator().manual_seed(6)
    suh = torch.randn(256, generator=generator).half()
    svh = torch.randn(128, generator=generator).half()
    weight = decode_weight(trellis, suh, svh, "mcg", in_features, out_features)
    assert weight.shape == (out_features, in_features) and weight.dtype == torch.float32
    assert weight.is_contiguous()
    h = sylvester_128()
    w_hat = decode_w_hat(trellis, "mcg").double()
    full = torch.diag(suh.double()) @ torch.block_diag(h, h) @ w_hat @ h @ torch.diag(svh.double())
    expected = full[:in_features, :out_features].T
    assert (weight.double() - expected).abs().max() < 1e-5 * expected.abs().max()


def test_sign_bitfields_decode_as_minus_one_for_a_set_bit():
    trellis = random_trellis(8, 8, 8, 32)
    generator = torch.Generator().manual_seed(9)
    set_bits = torch.randint(0, 2, (128,), generator=generator)
    # bit i of word j is element 16 * j + i
    words = [sum(int(set_bits[16 * j + i]) << i for i in range(16)) for j in range(8)]
    su = torch.tensor([w - 0x10000 if w >= 0x8000 else w for w in words], dtype=torch.int16)
    svh = torch.randn(128, generator=generator).half()
    from_bits = decode_weight(trellis, su, svh, "3inst", 128, 128)
    from_halves = decode_weight(trellis, (1 - 2 * set_bits).half(), svh, "3inst", 128, 128)
    assert torch.equal(from_bits, from_halves)


# ----------------------------------------------------------------------------------------------------------
# Encoder -> decoder
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("out_features", "in_features"), [(256, 384), (192, 576)])
def test_encoded_weight_decodes_within_a_4_bit_error_bound(out_features, in_features):
    tensors = encoded(out_features, in_features, 4)
    in_p, out_p = -(-in_features // 128) * 128, -(-out_features // 128) * 128
    assert (
        tensors["trellis"].shape == (in_p // 16, out_p // 16, 64) and tensors["trellis"].dtype == torch.int16
    )
    assert tensors["suh"].shape == (in_p,) and tensors["svh"].shape == (out_p,)
    assert tensors["suh"].dtype == tensors["svh"].dtype == torch.float16
    decoded = decoded_from(tensors, out_features, in_features)
    assert relative_error(decoded, source_weight(out_features, in_features)) < K4_BOUND


def test_more_bits_give_a_smaller_error():
    # measured: K=2 0.303, K=3 0.165, K=4 0.092, K=6 0.040
    errors = [
        relative_error(decoded_from(encoded(256, 384, bits), 256, 384), source_weight(256, 384))
        for bits in (2, 3, 4, 6)
    ]
    assert errors == sorted(errors, reverse=True) and len(set(errors)) == 4
    assert errors[-1] < 0.05


@pytest.mark.parametrize("codebook", ["mcg", "mul1"])
def test_other_codebooks_encode_with_their_marker(codebook):
    tensors = encode_weight(source_weight(128, 128), 4, codebook, seed=1)
    marker = tensors[codebook]
    assert marker.dim() == 0 and marker.dtype == torch.int32
    assert int(marker) & 0xFFFFFFFF == {"mcg": 0xCBAC1FED, "mul1": 0x83DCD12D}[codebook]
    assert codebook_of(tensors) == codebook
    assert relative_error(decoded_from(tensors, 128, 128), source_weight(128, 128)) < K4_BOUND


def test_padding_and_zero_features_decode_to_exact_zeros():
    source = source_weight(192, 200).clone()
    source[:, 7] = 0.0  # an input feature no output uses
    source[3] = 0.0  # an output feature with no weights
    tensors = encode_weight(source, 3, seed=2, effort=128)
    assert torch.all(tensors["suh"][200:] == 0) and torch.all(tensors["svh"][192:] == 0)
    decoded = decoded_from(tensors, 192, 200)
    assert torch.all(decoded[:, 7] == 0) and torch.all(decoded[3] == 0)
    assert relative_error(decoded, source) < 0.25


def test_encoder_is_deterministic_for_a_seed_and_signs_follow_the_seed():
    source = source_weight(128, 128)
    first, second, other = (encode_weight(source, 2, seed=s, effort=64) for s in (4, 4, 5))
    for name in ("trellis", "suh", "svh"):
        assert torch.equal(first[name], second[name])
    assert not torch.equal(first["suh"].sign(), other["suh"].sign())


# ----------------------------------------------------------------------------------------------------------
# The layout matters
# ----------------------------------------------------------------------------------------------------------


def normalised_mse(decoded: torch.Tensor, source: torch.Tensor) -> float:
    return ((decoded - source).square().mean() / source.square().mean()).item()


def test_decoding_with_the_permutation_reversed_loses_the_weight(monkeypatch):
    source = source_weight(256, 384)
    tensors = encoded(256, 384, 4)
    assert normalised_mse(decoded_from(tensors, 256, 384), source) < K4_BOUND**2
    reversed_perm = tensor_core_perm().flip(0)
    monkeypatch.setattr(exl3_decode, "_tensor_core_perm", lambda: reversed_perm)
    exl3_decode._window_indices.cache_clear()
    try:
        assert normalised_mse(decoded_from(tensors, 256, 384), source) >= 0.5
    finally:
        exl3_decode._window_indices.cache_clear()


def test_decoding_without_swap16_loses_the_weight():
    source = source_weight(256, 384)
    tensors = dict(encoded(256, 384, 4))
    trellis = tensors["trellis"]
    # A decoder that took the stored uint16 words in file order would read this trellis as this one does.
    tensors["trellis"] = trellis.view(*trellis.shape[:2], -1, 2).flip(-1).reshape(trellis.shape)
    assert normalised_mse(decoded_from(tensors, 256, 384), source) >= 0.5


# ----------------------------------------------------------------------------------------------------------
# Bad input
# ----------------------------------------------------------------------------------------------------------


def test_trellis_of_the_wrong_shape_for_the_features_is_named():
    tensors = encoded(256, 384, 4)
    with pytest.raises(InputError, match=r"trellis \[24, 16, 64\] does not tile .*in_features=512"):
        decode_weight(tensors["trellis"], tensors["suh"], tensors["svh"], "3inst", 512, 256)


@pytest.mark.parametrize(("words", "dtype"), [(144, torch.int16), (20, torch.int16), (0, torch.int16)])
def test_bitrate_outside_1_to_8_is_named(words, dtype):
    with pytest.raises(InputError, match=f"trellis width {words} words is no EXL3 bitrate"):
        trellis_bits(torch.zeros(8, 8, words, dtype=dtype))


def test_trellis_that_is_not_3d_int16_is_named():
    with pytest.raises(InputError, match=r"trellis is int32 \[8, 8, 64\], not a 3-D int16 tensor"):
        decode_w_hat(torch.zeros(8, 8, 64, dtype=torch.int32), "3inst")


def test_unknown_codebook_is_named():
    with pytest.raises(InputError, match="unknown EXL3 codebook 'qtip'"):
        decode_w_hat(random_trellis(1, 8, 8, 32), "qtip")
    with pytest.raises(InputError, match="unknown EXL3 codebook 'qtip'"):
        codebook_table("qtip")


def test_half_integer_bitrate_needs_mul1():
    assert trellis_bits(random_trellis(1, 8, 8, 40)) == 2.5
    with pytest.raises(InputError, match=r"half-integer bitrate 2\.5 with the mcg codebook"):
        decode_w_hat(random_trellis(1, 8, 8, 40), "mcg")


def test_sign_vectors_of_the_wrong_length_are_named():
    trellis = random_trellis(2, 40, 16, 64)  # in 576 -> 640, out 192 -> 256
    suh, svh = torch.ones(640).half(), torch.ones(256).half()
    with pytest.raises(InputError, match=r"suh has 576 elements, expected 640 \(input feature padded"):
        decode_weight(trellis, torch.ones(576).half(), svh, "3inst", 576, 192)
    with pytest.raises(InputError, match=r"svh has 192 elements, expected 256 \(output feature padded"):
        decode_weight(trellis, suh, torch.ones(192).half(), "3inst", 576, 192)
    with pytest.raises(InputError, match=r"su has 36 words, expected 40"):
        decode_weight(trellis, torch.zeros(36, dtype=torch.int16), svh, "3inst", 576, 192)
    with pytest.raises(InputError, match=r"svh/sv is float32 \[256\]"):
        decode_weight(trellis, suh, torch.ones(256), "3inst", 576, 192)


def test_encoder_names_bad_input():
    with pytest.raises(InputError, match=r"bits per weight 9 is not an integer K in 1..8"):
        encode_weight(source_weight(128, 128), 9)
    with pytest.raises(InputError, match="unknown EXL3 codebook 'qtip'"):
        encode_weight(source_weight(128, 128), 4, "qtip")
    with pytest.raises(InputError, match=r"not a 2-D floating-point tensor"):
        encode_weight(torch.zeros(128, dtype=torch.float32), 4)


# ----------------------------------------------------------------------------------------------------------
# exllamav3's own W_hat (golden vectors written on a CUDA machine)
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.skipif(
    not GOLDEN.exists(),
    reason=f"{GOLDEN.name} is absent: bench/exl3_gpu_check.sh writes it on a machine with CUDA and exllamav3",
)
def test_w_hat_is_bit_equal_to_exllamav3s_golden_vectors():
    from safetensors import safe_open

    with safe_open(str(GOLDEN), "pt") as golden:
        cases = json.loads(golden.metadata()["cases"])
        assert cases
        for case in cases:
            name = case["name"]
            trellis = golden.get_tensor(f"{name}.trellis")
            expected = golden.get_tensor(f"{name}.w_hat")
            assert trellis_bits(trellis) == case["bits"]
            w_hat = decode_w_hat(trellis, case["codebook"])
            assert torch.equal(w_hat.view(torch.int16), expected.view(torch.int16)), name
        stored = set(golden.keys())
        if "codebook.3inst" in stored:
            for codebook in ("3inst", "mcg", "mul1"):
                expected = golden.get_tensor(f"codebook.{codebook}")
                assert torch.equal(codebook_table(codebook).view(torch.int16), expected.view(torch.int16))
