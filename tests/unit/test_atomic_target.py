"""`run_folder.atomic_target`, the one way evalsuite replaces a file: a reader sees the old file or the whole
new one, a failed writer leaves nothing behind, and the file gets the umask's mode, not mkstemp's 0600."""

from __future__ import annotations

import os

import numpy as np
import pytest

from evalsuite.files.run_folder import atomic_target, write_atomic


def test_a_completed_block_replaces_the_file_with_the_umask_s_mode(tmp_path):
    path = tmp_path / "a.bin"
    path.write_bytes(b"old")
    with atomic_target(path) as tmp:
        assert tmp.parent == tmp_path and tmp != path
        tmp.write_bytes(b"new")
        assert path.read_bytes() == b"old"
    umask = os.umask(0)
    os.umask(umask)
    assert path.read_bytes() == b"new" and (path.stat().st_mode & 0o777) == (0o666 & ~umask)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.bin"]


def test_a_failed_block_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "a.bin"
    path.write_bytes(b"old")
    with pytest.raises(RuntimeError), atomic_target(path) as tmp:
        tmp.write_bytes(b"half")
        raise RuntimeError("the writer failed")
    assert path.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.bin"]


def test_a_writer_that_appends_its_own_suffix_is_given_it(tmp_path):
    path = tmp_path / "x.npy"
    with atomic_target(path, suffix=".npy") as tmp:
        np.save(tmp, np.arange(3))
    assert np.load(path).tolist() == [0, 1, 2]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.npy"]


def test_write_atomic_writes_text_through_it(tmp_path):
    write_atomic(tmp_path / "sub" / "r.json", "{}\n")
    assert (tmp_path / "sub" / "r.json").read_text() == "{}\n"
