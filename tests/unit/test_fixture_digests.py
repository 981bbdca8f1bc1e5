"""Each fixture's content digest is pinned: a build that drifts (another CPU's kernels, another thread count,
an environment variable that leaks into a file) fails here, on the machine where it happens.

The digests hold for the library versions and the Python-docs corpus they were pinned under (another
torch or transformers may write other bytes, another Python has other pydoc topics); under others the
test is skipped with what differs, and the digests are re-pinned from a build of the new versions.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest

from evalsuite.files.checkpoint import Checkpoint
from evalsuite.files.digest import DigestCache
from evalsuite.fixtures import (
    SMOLLM2_BF16,
    SMOLLM2_EXL3,
    SMOLLM2_W4A8,
    TINY_BF16,
    TINY_EXL3,
    TINY_MTP_BF16,
    TINY_MTP_EXL3,
    TINY_W4A8,
)
from evalsuite.fixtures.cache import library_versions
from evalsuite.inputs.corpus import python_docs_text

# `Checkpoint.content_sha256()` of each fixture built by FIXTURE_CODE_VERSION "evalsuite.fixtures/2" (the EXL3
# ones by ENCODER_VERSION 2), the same under the default kernels, ATEN_CPU_CAPABILITY=default,
# ONEDNN_MAX_CPU_ISA=SSE41, one thread and HF_HUB_OFFLINE=1, on an AMD CPU with AVX2 and an Intel one with
# AVX-512 (the EXL3 packs also under MKL_CBWR=COMPATIBLE, MKL's AMD path) (README, "Fixtures are the same
# bytes on every machine").
PINNED: dict[str, str] = {
    TINY_BF16: "d2e615150f59ce52d8691ea1401d684e7f2b12bf7be37ec73b9f87907a4ad3e2",
    TINY_W4A8: "53ba854262e478916da46372f0150b524ebb50fe8e3a9c510a47aa7645892166",
    TINY_EXL3: "96bd39092b4912562eed33c7c830702fc6ecea8b689259410a4cb83450ee82f6",
    SMOLLM2_BF16: "76e7595d1e0f8abe015b7c1fd890b5bf260c61cb365b007ff85d42f0c0a71d92",
    SMOLLM2_W4A8: "feb3cca1febe3831d4bd6c745b97514622363d18632c30514bdc4677cc269366",
    SMOLLM2_EXL3: "3e87184b6d38171f3d8956015e9dd25040daf29db610c9ac1f88dc85f8308511",
    TINY_MTP_BF16: "c3562b78c89b85743297989c448e1d784c4d7f27bd4c989745e79beaeabbad78",
    TINY_MTP_EXL3: "c2f624beb2d13b4826ffd0a02e25d12be19b9b955a2f89f07490375c2640e0d7",
}
PINNED_LIBRARIES = {
    "compressed-tensors": "0.20.1",
    "safetensors": "0.8.0",
    "tokenizers": "0.23.3",
    "torch": "2.13.0+cpu",
    "transformers": "5.24.0",
}
# The tiny tokenizer is trained on this Python's pydoc topics.
PINNED_CORPUS_SHA256 = "d9dc35bce5ab1a24ed7f4c3c9b7c22450410e9d68279e3426db458c6be371621"


def assert_pinned(name: str, folder: Path) -> None:
    """Fail unless the fixture in `folder` has the pinned content digest (skip under other versions)."""
    libraries = library_versions()
    if libraries != PINNED_LIBRARIES:
        changed = {k: v for k, v in libraries.items() if PINNED_LIBRARIES.get(k) != v}
        pytest.skip(f"fixture digests were pinned under {PINNED_LIBRARIES}; here {changed}: re-pin them")
    if name.startswith("tiny"):
        corpus = hashlib.sha256(python_docs_text().encode("utf-8")).hexdigest()
        if corpus != PINNED_CORPUS_SHA256:
            pytest.skip("the tiny fixtures were pinned on another Python's pydoc topics: re-pin them")
    digest = Checkpoint.open(folder).content_sha256(DigestCache(None))
    assert digest == PINNED[name], (
        f"{name} built here has content digest {digest}, pinned {PINNED[name]}: a build step depends on "
        "the machine or the environment"
    )


@pytest.mark.parametrize("name", [TINY_BF16, TINY_W4A8])
def test_tiny_fixtures_have_their_pinned_digests(tiny_pair, name):
    assert_pinned(name, tiny_pair[name])


def test_tiny_exl3_fixture_has_its_pinned_digest(tiny_exl3_pair):
    assert_pinned(TINY_EXL3, tiny_exl3_pair[TINY_EXL3])


@pytest.mark.parametrize("name", [TINY_MTP_BF16, TINY_MTP_EXL3])
def test_tiny_mtp_fixtures_have_their_pinned_digests(tiny_mtp_exl3_pair, name):
    assert_pinned(name, tiny_mtp_exl3_pair[name])


def test_a_fixture_with_one_flipped_bit_fails_its_pin(tiny_pair, tmp_path):
    copy = tmp_path / TINY_BF16
    shutil.copytree(tiny_pair[TINY_BF16], copy)
    weights = copy / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1  # the last byte of the last tensor: the header still parses
    weights.write_bytes(bytes(data))
    with pytest.raises(AssertionError, match="depends on the machine"):
        assert_pinned(TINY_BF16, copy)


@pytest.mark.slow
@pytest.mark.parametrize("name", [SMOLLM2_BF16, SMOLLM2_W4A8])
def test_smollm2_fixtures_have_their_pinned_digests(smollm2_pair, name):
    assert_pinned(name, smollm2_pair[name])


@pytest.mark.slow
def test_smollm2_exl3_fixture_has_its_pinned_digest(smollm2_exl3_pair):
    assert_pinned(SMOLLM2_EXL3, smollm2_exl3_pair[SMOLLM2_EXL3])
