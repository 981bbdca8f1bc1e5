"""evalsuite/formats/gguf.py on what it reads from the gguf package's tables: a type's bits, the type a
llama.cpp file type names, and a file whose header cannot be trusted."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import gguf
import numpy as np
import pytest

from evalsuite.backends.llamacpp import head_weight
from evalsuite.errors import InputError
from evalsuite.formats.gguf import as_claimed, bits_per_weight, claimed_type, nominal_bits, read_gguf


@pytest.mark.parametrize(
    ("type_name", "bits", "bpw"),
    [("Q4_0", 4, 4.5), ("Q8_0", 8, 8.5), ("Q4_K", 4, 4.5), ("Q6_K", 6, 6.5625), ("IQ2_XXS", 2, 2.0625),
     ("MXFP4", 4, 4.25), ("BF16", 16, 16.0), ("F32", 32, 32.0)],
)  # fmt: skip
def test_a_types_bits_count_its_blocks_scales_as_llama_cpp_does(type_name, bits, bpw):
    assert nominal_bits(type_name) == bits
    assert bits_per_weight(type_name) == bpw


@pytest.mark.parametrize(
    ("file_type", "expected"),
    [("MOSTLY_Q4_0", "Q4_0"), ("MOSTLY_Q4_K_M", "Q4_K"), ("MOSTLY_Q3_K_L", "Q3_K"),
     ("MOSTLY_IQ2_XXS", "IQ2_XXS"), ("MOSTLY_IQ3_M", "IQ3_S"), ("MOSTLY_IQ2_M", "IQ2_S"),
     ("MOSTLY_MXFP4_MOE", "MXFP4"), ("ALL_F32", "F32"), ("MOSTLY_BF16", "BF16")],
)  # fmt: skip
def test_a_file_type_names_the_type_most_linear_weights_have(file_type, expected):
    assert claimed_type(int(gguf.LlamaFileType[file_type])) == expected


def test_an_unknown_file_type_claims_nothing():
    assert claimed_type(9999) is None and claimed_type("Q4_0") is None


def _one_tensor_file(path: Path) -> tuple[int, int]:
    writer = gguf.GGUFWriter(path, "llama")
    data = gguf.quants.quantize(np.ones((4, 64), dtype=np.float32), gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("blk.0.ffn_up.weight", data, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path.stat().st_size, data.nbytes


def test_a_file_is_read_with_its_tensors_shape_in_the_sources_order(tmp_path):
    size, nbytes = _one_tensor_file(tmp_path / "a.gguf")
    found = read_gguf(tmp_path / "a.gguf")
    (tensor,) = found.tensors
    assert (tensor.name, tensor.type_name, tensor.shape) == ("blk.0.ffn_up.weight", "Q8_0", (4, 64))
    assert tensor.data_end - tensor.data_begin == nbytes and tensor.data_end <= size
    assert found.architecture == "llama"


@pytest.mark.parametrize("where", ["in the tensor data", "in the header"])
def test_a_truncated_file_is_refused_naming_it(tmp_path, where):
    path = tmp_path / "a.gguf"
    _one_tensor_file(path)
    (tensor,) = read_gguf(path).tensors
    with path.open("r+b") as f:
        f.truncate(tensor.data_end - 1 if where == "in the tensor data" else 8)
    with pytest.raises(InputError) as caught:
        read_gguf(path)
    assert "a.gguf" in str(caught.value) and "\n" not in str(caught.value)


def _three_tensor_file(path: Path) -> list[str]:
    """Three Q8_0 tensors of 4 rows of 64 weights (272 bytes each, 288 padded to 32), laid out as llama.cpp
    writes them; their names in the table's order."""
    writer = gguf.GGUFWriter(path, "llama")
    names = [f"blk.{i}.ffn_up.weight" for i in range(3)]
    for i, name in enumerate(names):
        data = gguf.quants.quantize(np.full((4, 64), i + 1, np.float32), gguf.GGMLQuantizationType.Q8_0)
        writer.add_tensor(name, data, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return names


def move_tensor_data(path: Path, moves: dict[int, int | str]) -> None:
    """Rewrite tensor infos' data offsets in place (relative to the data section, as the file stores them):
    tensor index → a byte offset, or the name of another tensor whose offset it takes."""
    reader = gguf.GGUFReader(path, "r+")
    offsets = {t.name: int(t.field.parts[-1][0]) for t in reader.tensors}
    for index, to in moves.items():
        reader.tensors[index].field.parts[-1][0] = offsets[to] if isinstance(to, str) else to
    del reader  # flushes the memory map


# Each layout llama.cpp refuses, and what the one line says: two infos on the same bytes, one starting
# inside the tensor before it, one past a gap, and two tensors' places swapped (no byte shared).
BAD_LAYOUTS = {
    "aliased": ({1: "blk.0.ffn_up.weight"}, "tensors 'blk.0.ffn_up.weight' and 'blk.1.ffn_up.weight' share"),
    "overlapping": ({2: 288 + 32}, "tensors 'blk.1.ffn_up.weight' and 'blk.2.ffn_up.weight' share"),
    "gap": ({1: 288 + 32}, "tensor 'blk.1.ffn_up.weight' has its data at byte"),
    "out of order": ({0: 288, 1: 0}, "tensor 'blk.0.ffn_up.weight' has its data at byte"),
}


@pytest.mark.parametrize("layout", BAD_LAYOUTS)
def test_tensors_that_share_bytes_or_leave_llama_cpps_layout_are_refused_naming_them(tmp_path, layout):
    path = tmp_path / "a.gguf"
    _three_tensor_file(path)
    assert len(read_gguf(path).tensors) == 3  # as written: each tensor where the one before it ends
    moves, line = BAD_LAYOUTS[layout]
    move_tensor_data(path, moves)
    with pytest.raises(InputError) as caught:
        read_gguf(path)
    message = str(caught.value)
    assert message.startswith(str(path)) and line in message and "\n" not in message, message


def test_a_files_own_alignment_places_its_tensors(tmp_path):
    """`general.alignment` 64: the second tensor's data begin 64-aligned after the first's 272 bytes."""
    path = tmp_path / "a.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_custom_alignment(64)
    for i in range(2):
        data = gguf.quants.quantize(np.ones((4, 64), np.float32), gguf.GGMLQuantizationType.Q8_0)
        writer.add_tensor(f"blk.{i}.ffn_up.weight", data, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    first, second = read_gguf(path).tensors
    assert second.data_begin - first.data_begin == 320
    move_tensor_data(path, {1: 288})  # where a 32-byte alignment would put it
    with pytest.raises(InputError) as caught:
        read_gguf(path)
    assert "'blk.1.ffn_up.weight' has its data at byte" in str(caught.value)


def head_file(path: Path, key: str | None = None, bias: bool = False) -> SimpleNamespace:
    """A GGUF holding a tied (vocab 8, hidden 4) embedding, with a logit transform key or an output bias."""
    writer = gguf.GGUFWriter(path, "llama")
    if key is not None:
        writer.add_float32(key, 0.5)
    weight = np.arange(32, dtype=np.float32).reshape(8, 4)
    writer.add_tensor("token_embd.weight", weight)
    if bias:
        writer.add_tensor("output.bias", np.zeros(8, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return SimpleNamespace(gguf_file=path)


def test_the_llamacpp_head_is_the_tied_embedding_read_as_stored(tmp_path):
    name, type_name, weight = head_weight(head_file(tmp_path / "m.gguf"))  # type: ignore[arg-type]
    assert (name, type_name) == ("token_embd.weight", "F32")
    assert np.array_equal(weight, np.arange(32, dtype=np.float32).reshape(8, 4))


@pytest.mark.parametrize(
    ("key", "bias"), [("llama.logit_scale", False), ("llama.final_logit_softcapping", False), (None, True)]
)
def test_a_head_with_more_than_a_matmul_is_refused_for_llamacpp_naming_what(tmp_path, key, bias):
    with pytest.raises(InputError, match="more than a matmul") as caught:
        head_weight(head_file(tmp_path / "m.gguf", key, bias))  # type: ignore[arg-type]
    assert (key or "output.bias") in str(caught.value)


@pytest.mark.parametrize(("type_name", "bound"), [("Q4_K", 0.12), ("Q6_K", 0.03)])
def test_llama_cpps_own_k_quant_decodes_through_the_gguf_package(type_name, bound):
    pytest.importorskip("xllamacpp", reason="the k-quant writer is llama.cpp's, from xllamacpp's wheel")
    from evalsuite.formats.ggml_library import ggml_quantize

    weights = np.random.default_rng(0).standard_normal((8, 512)).astype(np.float32)
    stored = ggml_quantize(weights, type_name)
    decoded = gguf.quants.dequantize(stored, gguf.GGMLQuantizationType[type_name]).reshape(weights.shape)
    assert 0 < np.linalg.norm(decoded - weights) / np.linalg.norm(weights) < bound
    with pytest.raises(ValueError, match="multiple of 256"):
        ggml_quantize(weights[:, :320], type_name)


def test_a_k_quant_files_fallback_rows_count_as_its_claimed_type():
    assert as_claimed("Q5_0", 576, "Q4_K") and as_claimed("Q4_K", 1536, "Q4_K")
    assert not as_claimed("Q5_0", 1536, "Q4_K")  # whole super-blocks: llama.cpp would have written Q4_K
    assert not as_claimed("Q8_0", 576, "Q4_K")
