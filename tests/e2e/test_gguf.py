"""Task `tensors` on GGUF files the `gguf` package writes from the tiny Llama: every type it writes passes
with its per-type counts and bits per weight, the converter's q/k permutation is undone, and a flipped byte
in one block's scale, one in its codes, a lying file type and a broken header each fail, naming the place.

The files are written here, per session, from the tiny Llama BF16 fixture by `fixtures/gguf_packs.py` (the
way llama.cpp's converter writes them); SmolLM2's are in `test_gguf_smollm2.py` (slow tier)."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from evalsuite.fixtures import build_fixtures
from evalsuite.fixtures.gguf_packs import write_llama_gguf
from tests.conftest import FIXTURES, run_cli
from tests.e2e.test_tensors import failed_checks, named, run_tensors

pytestmark = pytest.mark.format_evidence(format="gguf", writer="the gguf package (llama.cpp's gguf-py)")
# A corrupted scale and a corrupted code word: each a claim of docs/formats.md's table.
WHERE = [pytest.param(w, marks=pytest.mark.format_evidence(claim=w)) for w in ("scale", "code")]

TINY_LLAMA = "tiny-llama-bf16"
# The packs written for the default tier: name → (Linear type, embedding type).
PACKS = {
    "q4_0": ("Q4_0", "Q8_0"),
    "q8_0": ("Q8_0", None),
    "q5_1": ("Q5_1", "Q8_0"),
    "mxfp4": ("MXFP4", "Q8_0"),
    "bf16": ("BF16", None),
}
UP = "model.layers.1.mlp.up_proj.weight"  # stored as blk.1.ffn_up.weight
Q = "model.layers.0.self_attn.q_proj.weight"  # stored permuted, as blk.0.attn_q.weight


@pytest.fixture(scope="session")
def tiny_llama() -> Path:
    return build_fixtures(FIXTURES, [TINY_LLAMA])[TINY_LLAMA]


@pytest.fixture(scope="session")
def tiny_ggufs(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One folder per pack, each holding its one .gguf file (read-only: copy before changing)."""
    root = tmp_path_factory.mktemp("tiny-gguf")
    folders = {}
    for name, (linear, embedding) in PACKS.items():
        (root / name).mkdir()
        write_llama_gguf(tiny_llama, root / name / f"tiny.{linear}.gguf", linear, embedding)
        folders[name] = root / name
    return folders


def rows(out: Path) -> dict[str, dict]:
    document = json.loads((out / "artifacts" / "tensors.json").read_text())
    return {row["name"]: row for row in document["tensors"]}


def gguf_copy(folder: Path, dst: Path) -> tuple[Path, Path]:
    """A writable copy of a pack's folder and its file."""
    shutil.copytree(folder, dst)
    return dst, next(dst.glob("*.gguf"))


def block_of(path: Path, gguf_name: str, row: int, block: int) -> tuple[int, np.ndarray, str]:
    """The absolute offset of one block of a tensor in the file, its bytes and the tensor's type."""
    import gguf

    reader = gguf.GGUFReader(path)
    tensor = next(t for t in reader.tensors if t.name == gguf_name)
    _, type_size = gguf.GGML_QUANT_SIZES[tensor.tensor_type]
    row_bytes = tensor.data.shape[-1]
    offset = tensor.data_offset + row * row_bytes + block * type_size
    raw = np.array(tensor.data[row, block * type_size : (block + 1) * type_size])
    return offset, raw, tensor.tensor_type.name


def flip_block_byte(path: Path, gguf_name: str, row: int, block: int, where: str) -> None:
    """Flip every bit of one byte of a Q4_0 or Q8_0 block (both start with their F16 scale): the scale's high
    byte (sign and exponent), or the byte holding the code of the block's largest weight."""
    import gguf
    from gguf.quants import dequantize

    offset, raw, type_name = block_of(path, gguf_name, row, block)
    if where == "scale":
        offset += 1
    else:
        values = dequantize(raw.reshape(1, -1), gguf.GGMLQuantizationType[type_name])[0]
        largest = int(np.argmax(np.abs(values)))
        # Q8_0: one int8 code per weight after the scale; Q4_0: weights j and j + 16 share byte j's nibbles.
        offset += 2 + (largest if type_name == "Q8_0" else largest % 16)
    with path.open("r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0xFF]))


@pytest.mark.parametrize("pack", PACKS)
@pytest.mark.format_evidence(claim="tensors")
def test_every_type_the_gguf_package_writes_passes_with_its_counts_and_bits(
    pack, tiny_llama, tiny_ggufs, tmp_path
):
    code, entry, err = run_tensors(tiny_ggufs[pack], tiny_llama, tmp_path / "run")
    assert code == 0, (err, entry.get("details"))
    m = entry["metrics"]
    linear, embedding = PACKS[pack]
    # 2 layers × 7 projections and the head in the Linear type, the embedding in its own, 5 norms in F32.
    counts = {linear: 15, "F32": 5}
    counts[embedding or linear] = counts.get(embedding or linear, 0) + 1
    assert m["gguf_tensor_types"] == ", ".join(f"{t} {n}" for t, n in sorted(counts.items()))
    assert m["gguf_file_type"].startswith(f"MOSTLY_{linear}")
    assert (m["missing"], m["unexpected"], m["config_mismatches"], m["tile_outliers"]) == (0, 0, 0, 0)
    # The norms, value-equal in F32; in a BF16 file every tensor kept in the source's row order, bytes equal.
    protected = 5 if linear != "BF16" else 17
    assert m["protected_total"] == m["protected_identical"] == protected
    # llama.cpp's own decode (xllamacpp's library) beside the gguf package's, on a sample of every tensor.
    if linear != "BF16" and importlib.util.find_spec("xllamacpp") is not None:
        assert m["decode_exact"] is True and m["decode_cross_check"] == "sample"
        assert m["decode_cross_checked_tensors"] == 16 and m["decode_cross_checked_weights"] > 0
    import gguf

    def bpw(type_name: str) -> float:  # the block's scales included: Q4_0 is 4.5
        block_size, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]]
        return 8 * type_size / block_size

    found = rows(tmp_path / "run")
    assert found[Q]["format"] == linear.lower() and found[Q]["bits_per_weight"] == bpw(linear)
    embed = found["model.embed_tokens.weight"]
    if embedding is not None:
        assert embed["format"] == embedding.lower() and embed["bits_per_weight"] == bpw(embedding)
    text = [r for r in found.values() if r["tensor_class"] == "quantized" and r["part"] == "text"]
    mean = sum(r["numel"] * r["bits_per_weight"] for r in text) / sum(r["numel"] for r in text)
    assert m["avg_bits_per_weight"] == pytest.approx(mean)  # the text backbone's, the embedding included
    # The permuted projections decode as close to their source as the unpermuted ones.
    v = found["model.layers.0.self_attn.v_proj.weight"]["rel_err"] or 0.0
    assert found[Q]["rel_err"] <= 1.5 * v + 1e-9
    assert "rows unpermuted" in found[Q]["note"]


def test_the_cli_reads_a_gguf_candidate_in_a_subprocess(tiny_llama, tiny_ggufs, tmp_path):
    done = run_cli("run", "--ckpt", tiny_ggufs["q4_0"], "--ref", tiny_llama, "--tasks", "tensors",
                   "--out", tmp_path / "run", "--quiet")  # fmt: skip
    assert done.returncode == 0, done.stderr
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert results["ckpt"]["format"] == "gguf"
    assert results["tasks"]["tensors"]["status"] == "pass"


def test_read_without_undoing_the_permutation_the_query_and_key_projections_fail(
    tiny_llama, tmp_path, monkeypatch
):
    """What the permutation is worth: the same file read as if nothing were permuted fails on q and k."""
    from evalsuite.tasks.tensors._verification import _gguf

    (tmp_path / "pack").mkdir()
    write_llama_gguf(tiny_llama, tmp_path / "pack" / "tiny.Q8_0.gguf", "Q8_0")
    monkeypatch.setattr(_gguf, "_row_order", lambda *args: None)
    code, _, _ = run_tensors(tmp_path / "pack", tiny_llama, tmp_path / "run")
    assert code == 1
    worst = rows(tmp_path / "run")
    assert worst[Q]["rel_err"] > 1.0  # unrelated rows: further off than zeros
    assert worst["model.layers.0.self_attn.v_proj.weight"]["rel_err"] < 0.01


@pytest.mark.parametrize("pack", ["q4_0", "q8_0"])
@pytest.mark.parametrize("where", WHERE)
def test_a_flipped_byte_in_one_block_fails_naming_the_tensor_and_the_block(
    pack, where, tiny_llama, tiny_ggufs, tmp_path
):
    folder, path = gguf_copy(tiny_ggufs[pack], tmp_path / "pack")
    row, block = 7, 1
    flip_block_byte(path, "blk.1.ffn_up.weight", row, block, where)
    code, entry, err = run_tensors(folder, tiny_llama, tmp_path / "run")
    assert code == 1, (err, entry.get("details"))
    assert "tile_outliers" in failed_checks(entry)
    blocks = named(entry, "block")
    assert list(blocks) == [UP]
    assert f"row {row}, weights {32 * block}..{32 * block + 31}" in blocks[UP]


def test_a_file_type_that_is_not_what_the_file_stores_fails(tiny_llama, tmp_path):
    import gguf

    (tmp_path / "pack").mkdir()
    path = tmp_path / "pack" / "tiny.gguf"
    write_llama_gguf(tiny_llama, path, "Q4_0", "Q8_0")
    reader = gguf.GGUFReader(path, "r+")
    reader.fields["general.file_type"].parts[-1][0] = int(gguf.LlamaFileType.MOSTLY_Q8_0)
    del reader  # flushes the memory map
    code, entry, _ = run_tensors(tmp_path / "pack", tiny_llama, tmp_path / "run")
    assert code == 1 and "config_mismatches" in failed_checks(entry)
    detail = named(entry, "config")["tiny.gguf: general.file_type"]
    assert "MOSTLY_Q8_0" in detail and "Q4_0" in detail


def test_a_hyperparameter_the_source_does_not_have_fails(tiny_llama, tmp_path):
    import gguf

    (tmp_path / "pack").mkdir()
    path = tmp_path / "pack" / "tiny.gguf"
    write_llama_gguf(tiny_llama, path, "Q8_0")
    reader = gguf.GGUFReader(path, "r+")
    reader.fields["llama.attention.head_count_kv"].parts[-1][0] = 4
    del reader
    code, entry, _ = run_tensors(tmp_path / "pack", tiny_llama, tmp_path / "run")
    assert code == 1
    assert (
        "says 4, the source's config.json says 2"
        in named(entry, "config")["tiny.gguf: llama.attention.head_count_kv"]
    )


@pytest.mark.format_evidence(claim="refused")
def test_a_truncated_gguf_is_refused_in_one_line_naming_the_file(tiny_llama, tiny_ggufs, tmp_path):
    folder, path = gguf_copy(tiny_ggufs["q8_0"], tmp_path / "pack")
    with path.open("r+b") as f:
        f.truncate(path.stat().st_size - 100)
    done = run_cli("run", "--ckpt", folder, "--ref", tiny_llama, "--tasks", "tensors",
                   "--out", tmp_path / "run", "--quiet")  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert len(done.error_lines) == 1 and str(path.name) in done.error_lines[0], done.stderr


def alias_second_tensor(path: Path) -> str:
    """Point the file's second tensor info at the first's bytes (llama.cpp refuses such a file); what the
    refusal names: "tensors 'first' and 'second'"."""
    import gguf

    reader = gguf.GGUFReader(path, "r+")
    first, second = reader.tensors[:2]
    second.field.parts[-1][0] = first.field.parts[-1][0]
    names = f"tensors {first.name!r} and {second.name!r}"
    del reader  # flushes the memory map
    return names


@pytest.mark.format_evidence(claim="refused")
def test_a_gguf_whose_tensors_share_bytes_is_refused_in_one_line_naming_the_file_and_them(
    tiny_llama, tiny_ggufs, tmp_path
):
    folder, path = gguf_copy(tiny_ggufs["q8_0"], tmp_path / "pack")
    names = alias_second_tensor(path)
    done = run_cli("run", "--ckpt", folder, "--ref", tiny_llama, "--tasks", "tensors",
                   "--out", tmp_path / "run", "--quiet")  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert len(done.error_lines) == 1, done.stderr
    assert str(path) in done.error_lines[0] and f"{names} share bytes" in done.error_lines[0], done.stderr


def test_the_memory_plan_of_a_gguf_file_is_its_source_s_dequantized(tiny_llama, tiny_ggufs):
    """Transformers dequantizes a GGUF file into the compute dtype: the plan counts its tensors (read from
    the GGUF header) at the dtype's bytes, as it counts the BF16 source's (0 bytes once: no safetensors)."""
    from evalsuite.backends.memory import loaded_bytes
    from evalsuite.backends.options import BackendOptions
    from evalsuite.files.checkpoint import Checkpoint

    source = loaded_bytes(Checkpoint.open(tiny_llama), BackendOptions())
    for name, folder in tiny_ggufs.items():
        planned = loaded_bytes(Checkpoint.open(folder), BackendOptions())
        assert abs(planned - source) <= 0.01 * source, (name, planned, source)
