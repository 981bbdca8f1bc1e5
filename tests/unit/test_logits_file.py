"""Window logits files: written whole under their final name, and taken by a resumed observation only when
they hold every byte their header promises."""

import os

import torch

from evalsuite.tasks.logits_file import LogitsWriter, is_complete, read_rows, window_file


def test_a_window_file_cut_short_is_not_taken_by_a_resumed_observation(tmp_path):
    rows = torch.randn(5, 40).to(torch.bfloat16)
    writer = LogitsWriter(tmp_path)
    writer.write(0, rows)
    writer.write(1, rows)
    writer.close()
    assert writer.done(0) and writer.done(1)
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary left behind
    (block,) = read_rows([window_file(tmp_path, 0)], 8)
    assert torch.equal(block, rows)
    path = window_file(tmp_path, 1)
    os.truncate(path, path.stat().st_size - 2)  # as a power cut after the rename could leave it
    assert not is_complete(path) and not LogitsWriter(tmp_path).done(1)
    path.write_bytes(b"not a numpy file")
    assert not is_complete(path)
    assert not LogitsWriter(tmp_path).done(2)  # never written
