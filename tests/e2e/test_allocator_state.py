"""glibc's malloc thresholds are the process's: `evalsuite.run` called from a program leaves them as it found
them, and the command line, whose process is evalsuite's own, sets the ones its loads need
(`evalsuite.backends.c_heap`), as does a program that asks for them (`evalsuite.tune_allocator`).

What is compared is glibc's behaviour, probed through `mallinfo2()` in a fresh process: whether a 512 KiB
block the heap cannot serve is mapped on its own (the mmap threshold), and whether 4 MiB freed at the top of
the main heap stays there (the trim threshold). The runs load both tiny sides whole and through a long
window's reduction, which are where evalsuite sets thresholds, and both streamed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from evalsuite.fixtures import TINY_BF16, TINY_W4A8


def _has_mallinfo2() -> bool:
    name = ctypes.util.find_library("c")
    return name is not None and hasattr(ctypes.CDLL(name), "mallinfo2")


pytestmark = pytest.mark.skipif(
    platform.libc_ver()[0] != "glibc" or not _has_mallinfo2(),
    reason="the thresholds are glibc's (mallopt, mallinfo2 from glibc 2.33); elsewhere evalsuite sets none",
)

# The probe and the run, in a process of their own. argv: mode (api | cli), ckpt, ref, out, long spec.
CHILD = r"""
import ctypes, ctypes.util, json, sys
from pathlib import Path

libc = ctypes.CDLL(ctypes.util.find_library("c"))
NAMES = "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()
class Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in NAMES]
libc.mallinfo2.restype = Mallinfo2
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
KiB, MiB = 1 << 10, 1 << 20
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3

def behaviour():
    # The mmap threshold: is a 512 KiB block a mapping of its own? The free lists and the heap's top serve a
    # request before glibc weighs the threshold, so blocks are taken until one is mapped or grows the heap.
    held = []
    while True:
        before = libc.mallinfo2()
        held.append(libc.malloc(512 * KiB))
        after = libc.mallinfo2()
        if after.hblks > before.hblks or after.arena > before.arena:
            mapped = after.hblks > before.hblks
            break
        assert len(held) < 4096, "the free lists never ran out"
    for block in held:
        libc.free(block)
    # The trim threshold: 128 KiB blocks (below any threshold here: from the heap) taken until one grows the
    # heap, so that the free lists hold none that fits and every next one comes from the top; 4 MiB more from
    # the top, freed last first, each merging into it: kept there, or handed back.
    drained, top = [], []
    arena = libc.mallinfo2().arena
    while libc.mallinfo2().arena == arena:
        drained.append(libc.malloc(128 * KiB))
        assert len(drained) < 8192, "the free lists never ran out"
    top = [libc.malloc(128 * KiB) for _ in range(32)]
    for block in reversed(top):
        libc.free(block)
    kept = libc.mallinfo2().keepcost >= 2 * MiB
    for block in drained:
        libc.free(block)
    return {"mapped_512k": mapped, "keeps_freed_top": kept}

mode, ckpt, ref, out, long_spec = sys.argv[1:6]
# A program's own allocator settings (fixed thresholds, as mallopt leaves them).
libc.mallopt(M_MMAP_THRESHOLD, 256 * KiB)
libc.mallopt(M_TRIM_THRESHOLD, 512 * KiB)
before = behaviour()
common = ["--corpus", "python-docs", "--quiet", "--no-plots"]
if mode == "api":
    import evalsuite
    evalsuite.run(ckpt, ref, tasks=["ppl"], specs={"ppl": Path(long_spec)}, out=Path(out) / "long",
                  corpus="python-docs", plots=False)
    evalsuite.run(ckpt, ref, tasks=["ppl"], out=Path(out) / "streamed", corpus="python-docs", plots=False,
                  stream=True)
elif mode == "tuned":  # a program that chose evalsuite's thresholds, as the command line does
    import evalsuite
    assert evalsuite.tune_allocator()
    evalsuite.run(ckpt, ref, tasks=["ppl"], specs={"ppl": Path(long_spec)}, out=Path(out) / "long",
                  corpus="python-docs", plots=False)
else:
    from evalsuite.cli.app import main
    try:
        main(["run", "--ckpt", ckpt, "--ref", ref, "--tasks", "ppl", "--spec", f"ppl={long_spec}",
              "--out", str(Path(out) / "long"), *common])
    except SystemExit as exc:
        assert exc.code in (0, 1), exc.code  # 1: a threshold failed, which is not judged here
print(json.dumps({"before": before, "after": behaviour()}))
"""

LONG_SPEC = """
[protocol]
window = 1024
starts = { first = 0, step = 1024, count = 1 }
scored = { first = 0, last = 1022 }

[long_context]
head_chunk_rows = 100
position_buckets = [0, 256, 512]
every_window = true
"""


def _probed(mode: str, tiny_pair: dict[str, Path], tmp_path: Path) -> dict[str, dict[str, bool]]:
    spec = tmp_path / "ppl-long.toml"
    spec.write_text(LONG_SPEC, encoding="utf-8")
    threads = {"OMP_NUM_THREADS": "1"} if os.environ.get("PYTEST_XDIST_WORKER") else {}
    args = [mode, str(tiny_pair[TINY_W4A8]), str(tiny_pair[TINY_BF16]), str(tmp_path / "runs"), str(spec)]
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, *args],
        capture_output=True,
        text=True,
        env={**threads, **os.environ},
        timeout=1200,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    probed = json.loads(proc.stdout.strip().splitlines()[-1])
    # The probe sees the program's own settings: a 512 KiB block mapped, freed memory above 512 KiB trimmed.
    assert probed["before"] == {"mapped_512k": True, "keeps_freed_top": False}
    return probed


def test_a_run_from_python_leaves_the_programs_malloc_thresholds_as_they_were(tiny_pair, tmp_path):
    probed = _probed("api", tiny_pair, tmp_path)
    assert probed["after"] == probed["before"]


@pytest.mark.parametrize("mode", ["cli", "tuned"])
def test_the_command_line_and_a_program_that_opts_in_set_the_thresholds_loads_need(mode, tiny_pair, tmp_path):
    probed = _probed(mode, tiny_pair, tmp_path)
    # The long window's reduction maps blocks of 1 MiB or more (a 512 KiB one comes from the heap), and after
    # the load the heap keeps what is freed at its top (the running trim threshold, 64 MiB).
    assert probed["after"] == {"mapped_512k": False, "keeps_freed_top": True}
