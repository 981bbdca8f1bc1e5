"""Full-vocabulary logit rows of the scored positions, one `.npy` file per window, written while the next
window runs where a core is left for it (else before it) and read back a few rows at a time.

The raw logits are stored, not log-probs: lossless at half the bytes of float32 for a bf16 model, and the
comparison normalises them itself. One file per window makes an interrupted observation resumable at the
window it stopped at: a window's file appears (renamed from a temporary name) only once it is written, and a
resumed observation takes it only if it holds every byte its header promises. No fsync: the rename already
keeps a half-written window from being taken, and a file a power cut truncated fails the length check; an
fsync per window made every run wait for the disk (a 248 k vocabulary writes 1 GB of logits per side).
Plain reads and writes rather than a memory map: mapped pages count as resident memory, and on a 248 k
vocabulary one side's logits are 1 GB.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from evalsuite.errors import InputError
from evalsuite.files.run_folder import atomic_target
from evalsuite.machine import usable_cores

# Logits are stored as the model produced them: bf16 logits as their raw 16 bits (numpy has no bfloat16).
STORED_DTYPES = {torch.bfloat16: "<u2", torch.float16: "<f2", torch.float32: "<f4"}


def window_file(folder: Path, window: int) -> Path:
    """Where window `window`'s logits live in an observation folder."""
    return folder / f"logits-{window:04d}.npy"


def core_left_for_writing(logits: torch.Tensor) -> bool:
    """Whether writing a window's logits while the next window runs takes no core from that forward: it runs
    on an accelerator, or this process may use more cores than torch's threads. Where it would, the write is
    better made before: on 2 cores busy with 2 torch threads, a write beside each forward left it and the
    scoring of each window waiting on a descheduled thread, and cost more than the write itself
    (bench/ppl.py)."""
    return logits.device.type != "cpu" or usable_cores() > torch.get_num_threads()


class LogitsWriter:
    """Writes each window's logit rows to its own file, in a background thread with one write in flight
    (which bounds the memory held to one window's logits), or at once."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="logits-writer")
        self._pending: Future[None] | None = None

    def done(self, window: int) -> bool:
        """Whether the window's file was completed (by this or an interrupted earlier observation)."""
        return is_complete(window_file(self.folder, window))

    def write(self, window: int, rows: torch.Tensor, background: bool = True) -> None:
        """Queue the rows (a CPU tensor, kept alive until written) for the window's file, or write them now
        (`background` false)."""
        if rows.dtype not in STORED_DTYPES:
            raise InputError(f"cannot store logits of dtype {rows.dtype}", self.folder)
        self.flush()
        if background:
            self._pending = self._writer.submit(self._write, window, rows.contiguous())
        else:
            self._write(window, rows.contiguous())

    def _write(self, window: int, rows: torch.Tensor) -> None:
        raw = rows.view(torch.uint16) if rows.dtype == torch.bfloat16 else rows
        header = {"descr": STORED_DTYPES[rows.dtype], "fortran_order": False, "shape": tuple(rows.shape)}
        with atomic_target(window_file(self.folder, window)) as tmp, tmp.open("wb") as fh:
            np.lib.format.write_array_header_1_0(fh, header)
            fh.write(memoryview(raw.numpy()))  # a view, not a copy

    def flush(self) -> None:
        """Wait for the write in flight; re-raises its error."""
        if self._pending is not None:
            self._pending.result()
            self._pending = None

    def close(self) -> None:
        try:
            self.flush()
        finally:
            self._writer.shutdown()


def write_window_chunks(folder: Path, window: int, n_rows: int, chunks: Iterator[torch.Tensor]) -> Path:
    """Window `window`'s file written from successive blocks of its rows (`n_rows` in all), one block in
    memory at a time: for a long window whose logits would not fit at once. Like `LogitsWriter`'s, the file
    appears under its final name only once complete, and reads back with `read_rows`."""
    final = window_file(folder, window)
    written = 0
    with atomic_target(final) as tmp, tmp.open("wb") as fh:
        for rows in chunks:
            if rows.dtype not in STORED_DTYPES:
                raise InputError(f"cannot store logits of dtype {rows.dtype}", folder)
            rows = rows.detach().cpu().contiguous()
            if written == 0:
                shape = (n_rows, int(rows.shape[1]))
                header = {"descr": STORED_DTYPES[rows.dtype], "fortran_order": False, "shape": shape}
                np.lib.format.write_array_header_1_0(fh, header)
            raw = rows.view(torch.uint16) if rows.dtype == torch.bfloat16 else rows
            fh.write(memoryview(raw.numpy()))
            written += len(rows)
        if written != n_rows:  # raised inside the block: the temporary file goes, nothing is renamed
            raise InputError(
                f"the model returned {written} logit rows for window {window}, expected {n_rows}"
            )
    return final


# A logits file's (shape, dtype, data offset), as `read_header` returns it.
Header = tuple[tuple[int, int], torch.dtype, int]


def read_header(path: Path) -> Header:
    """(shape, dtype, data offset) of a logits file; InputError unless a row-major 2-D logits array."""
    with path.open("rb") as fh:
        fmt = np.lib.format
        try:
            version = fmt.read_magic(fh)
            readers = {(1, 0): fmt.read_array_header_1_0, (2, 0): fmt.read_array_header_2_0}
            shape, fortran, descr = readers[version](fh) if version in readers else ((), True, None)
        except ValueError:
            shape, fortran, descr = (), True, None
        offset = fh.tell()
    dtypes = {np.dtype(v): k for k, v in STORED_DTYPES.items()}
    if fortran or len(shape) != 2 or descr not in dtypes:
        raise InputError("not a row-major 2-D logits array", path)
    return shape, dtypes[descr], offset


def is_complete(path: Path) -> bool:
    """Whether a window's logits file holds every byte its header promises (a file cut short by a crash
    after its rename, say, does not)."""
    try:
        (rows, cols), dtype, offset = read_header(path)
        return path.stat().st_size == offset + rows * cols * torch.empty((), dtype=dtype).element_size()
    except (OSError, InputError):
        return False


def read_rows(paths: list[Path], n_rows: int, headers: list[Header] | None = None) -> Iterator[torch.Tensor]:
    """Successive blocks of up to `n_rows` rows of the files in order (a block never spans two files),
    read into one reused buffer: each block is valid until the next. `headers`: the files' `read_header`s,
    when read already. numpy parses a header with `ast.literal_eval`, which CPython 3.11.7 fails in two
    threads at once (a spurious "AST constructor recursion depth mismatch", seen in a full test run), so
    threads reading files are handed their headers."""
    buffer: torch.Tensor | None = None
    for i, path in enumerate(paths):
        shape, dtype, offset = headers[i] if headers is not None else read_header(path)
        if buffer is None or buffer.dtype != dtype or buffer.shape[1] != shape[1]:
            buffer = torch.empty((n_rows, shape[1]), dtype=dtype)
        raw = buffer.view(torch.uint16) if dtype == torch.bfloat16 else buffer
        with path.open("rb") as fh:
            fh.seek(offset)
            for start in range(0, shape[0], n_rows):
                rows = min(n_rows, shape[0] - start)
                block = raw[:rows].numpy()
                if fh.readinto(memoryview(block).cast("B")) != block.nbytes:
                    raise InputError("logits file is shorter than its header says", path)
                yield buffer[:rows]
