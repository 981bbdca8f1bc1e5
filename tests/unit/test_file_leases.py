"""Leases on the files a run maps (`evalsuite.files.leases`): a process that opens one to write or cuts it
short ends the run in its main thread with `FileChangedError` before it may proceed; when the watch ends,
every lease is let go and SIGIO's handler is what it was, so a later writer neither waits nor kills the
process; a watch outside the main thread changes nothing. And a file's identity (`evalsuite.files.identity`)
tells each kind of change apart."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from evalsuite.files import leases as file_leases
from evalsuite.files.checkpoint import Checkpoint
from evalsuite.files.identity import FileChangedError, FileIdentity, check_unchanged

LEASES = pytest.mark.skipif(
    not hasattr(__import__("fcntl"), "F_SETLEASE"), reason="read leases are Linux's (F_SETLEASE)"
)
OPEN_TO_WRITE = "import sys; open(sys.argv[1], 'r+b').close()"


def _checkpoint(folder: Path) -> Checkpoint:
    folder.mkdir()
    save_file({"w": torch.ones(4096, dtype=torch.bfloat16)}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return Checkpoint.open(folder)


@LEASES
def test_a_process_opening_a_mapped_shard_to_write_ends_the_watch_before_it_proceeds(tmp_path):
    checkpoint = _checkpoint(tmp_path / "ckpt")
    shard = checkpoint.shards[0]
    before = signal.getsignal(signal.SIGIO)
    with (
        pytest.raises(FileChangedError, match="another process opened it to write") as caught,
        file_leases.watching() as leased,
    ):
        assert leased
        with checkpoint.open_tensors(["w"]) as handles:
            kept = handles["w"][...]
        # The writer waits for the lease; its break is heard while this process waits for the writer.
        subprocess.run([sys.executable, "-c", OPEN_TO_WRITE, str(shard)], check=True)
    assert caught.value.path == shard
    assert signal.getsignal(signal.SIGIO) == before
    assert float(kept.float().sum()) == 4096


@LEASES
def test_after_the_watch_a_writer_neither_waits_nor_ends_the_process(tmp_path):
    checkpoint = _checkpoint(tmp_path / "ckpt")
    with file_leases.watching() as leased:
        assert leased
        with checkpoint.open_tensors(["w"]) as handles:
            kept = handles["w"][...]  # the shard stays mapped after the watch
    # With a lease left behind, the writer's open would send SIGIO, whose default ends this process.
    subprocess.run([sys.executable, "-c", OPEN_TO_WRITE, str(checkpoint.shards[0])], check=True, timeout=30)
    assert float(kept.float().sum()) == 4096


def test_a_watch_outside_the_main_thread_takes_no_lease_and_sets_no_handler():
    seen = []
    before = signal.getsignal(signal.SIGIO) if hasattr(signal, "SIGIO") else None

    def watch() -> None:
        with file_leases.watching() as leased:
            seen.append(leased)

    thread = threading.Thread(target=watch)
    thread.start()
    thread.join()
    assert seen == [False]
    assert (signal.getsignal(signal.SIGIO) if hasattr(signal, "SIGIO") else None) == before


def _replace(path: Path) -> None:
    path.with_name("new").write_bytes(path.read_bytes())
    os.replace(path.with_name("new"), path)


def _rewrite(path: Path, mtime_ns: int) -> None:
    path.write_bytes(b"y" * path.stat().st_size)
    os.utime(path, ns=(mtime_ns, mtime_ns))


def _replace(path: Path) -> None:
    path.with_name("new").write_bytes(path.read_bytes())
    os.replace(path.with_name("new"), path)


def _rewrite(path: Path, mtime_ns: int) -> None:
    # Written within the clock tick of the identity taken, a file keeps its times (the module docstring of
    # evalsuite.files.identity says so): this rewrite stamps a later time, as one made later would.
    path.write_bytes(b"y" * path.stat().st_size)
    os.utime(path, ns=(mtime_ns, mtime_ns))


def _after_a_clock_tick(path: Path, change) -> None:
    # A change within the file system's clock tick of the identity keeps its times (module docstring of
    # evalsuite.files.identity): wait for the status-change time to move, so the change is seen if judged.
    before = os.stat(path).st_ctime_ns
    while True:
        change()
        if os.stat(path).st_ctime_ns != before:
            return
        time.sleep(0.005)


def test_a_metadata_change_is_not_taken_for_a_rewrite(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"x" * 100)
    status = os.stat(path)
    changes = {
        "a hard link": lambda: os.link(path, tmp_path / f"link-{time.monotonic_ns()}"),
        "chmod": lambda: os.chmod(path, 0o600),
        "chown to the same owner": lambda: os.chown(path, status.st_uid, status.st_gid),
    }
    for change in changes.values():
        identity = FileIdentity.of(os.stat(path))
        _after_a_clock_tick(path, change)
        check_unchanged(path, identity)  # only the status-change time moved: the bytes are the same
    # The same file rewritten, its size and status-change time alone kept, is still a change.
    identity = FileIdentity.of(os.stat(path))
    _rewrite(path, identity.mtime_ns + 10**9)
    with pytest.raises(FileChangedError, match="rewritten in place"):
        check_unchanged(path, identity)


def test_a_files_identity_tells_each_change_apart(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"x" * 100)
    check_unchanged(path, FileIdentity.of(os.stat(path)))  # nothing changed
    cases = {
        "rewritten in place": lambda identity: _rewrite(path, identity.mtime_ns + 10**9),
        "cut short: 10 bytes, 100 when opened": lambda identity: os.truncate(path, 10),
        "another file now stands at its path": lambda identity: _replace(path),
        "it is gone": lambda identity: path.unlink(),
    }
    for said, change in cases.items():
        path.write_bytes(b"x" * 100)
        identity = FileIdentity.of(os.stat(path))
        change(identity)
        with pytest.raises(FileChangedError, match=f"changed while evalsuite ran \\({said}\\)"):
            check_unchanged(path, identity)
