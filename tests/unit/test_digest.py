"""File digests cached by identity: an unchanged file is not read again; any change is seen."""

from __future__ import annotations

import hashlib
import os
import shutil

import pytest

from evalsuite.files import digest
from evalsuite.files import identity as file_identity
from evalsuite.files.checkpoint import Checkpoint
from evalsuite.files.digest import DigestCache


@pytest.fixture
def shard(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(os.urandom(1 << 20))
    return path


def test_the_digest_is_the_sha256_of_the_bytes(shard, tmp_path):
    cache = DigestCache(tmp_path / "cache")
    assert cache.sha256(shard) == hashlib.sha256(shard.read_bytes()).hexdigest()


def test_an_unchanged_file_is_not_read_again(shard, tmp_path):
    DigestCache(tmp_path / "cache").sha256(shard)
    again = DigestCache(tmp_path / "cache")
    again.sha256(shard)
    assert again.hashed_bytes == 0


def test_an_in_place_edit_that_restores_the_mtime_is_still_seen(shard, tmp_path):
    cache = DigestCache(tmp_path / "cache")
    before = cache.sha256(shard)
    stat = shard.stat()
    data = bytearray(shard.read_bytes())
    data[12345] ^= 0x01
    with shard.open("r+b") as fh:  # same inode, same size
        fh.write(data)
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # `touch -r`: the old mtime back
    fresh = DigestCache(tmp_path / "cache")
    assert fresh.sha256(shard) != before
    assert fresh.hashed_bytes == len(data)


def test_a_digest_is_cached_under_the_one_file_identity_runs_check():
    # One home for what tells a file's states apart: a second definition would drift from the first.
    assert digest.FileIdentity is file_identity.FileIdentity


def test_without_a_cache_folder_every_call_reads_the_file(shard):
    cache = DigestCache(None)
    cache.sha256(shard)
    cache.sha256(shard)
    assert cache.hashed_bytes == 2 * shard.stat().st_size


def test_content_digest_sees_weights_and_configs_but_not_documentation(tiny_pair, tmp_path):
    folder = shutil.copytree(tiny_pair["tiny-minicpmv47-w4a8"], tmp_path / "copy")
    cache = DigestCache(tmp_path / "cache")
    before = Checkpoint.open(folder).content_sha256(cache)
    (folder / "README.md").write_text("# a model card\n")
    assert Checkpoint.open(folder).content_sha256(cache) == before
    (folder / "generation_config.json").write_text('{"do_sample": true}')
    changed_config = Checkpoint.open(folder).content_sha256(cache)
    assert changed_config != before
    shard = folder / "model.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0x01  # one bit of the last tensor's data: the headers (and fingerprint) are unchanged
    shard.write_bytes(data)
    reopened = Checkpoint.open(folder)
    assert reopened.content_sha256(cache) != changed_config
