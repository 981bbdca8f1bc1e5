"""Window logits files: written whole under their final name, and taken by a resumed observation only when
they hold every byte their header promises."""

import os

import torch

from evalsuite.observers.logits_file import (
    LogitsWriter,
    core_left_for_writing,
    is_complete,
    read_rows,
    window_file,
)


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


def test_a_window_written_at_once_is_the_file_written_in_the_background(tmp_path):
    rows = torch.randn(7, 33).to(torch.bfloat16)
    for folder, background in ((tmp_path / "now", False), (tmp_path / "behind", True)):
        folder.mkdir()
        writer = LogitsWriter(folder)
        writer.write(0, rows, background=background)
        writer.close()
    assert window_file(tmp_path / "now", 0).read_bytes() == window_file(tmp_path / "behind", 0).read_bytes()


def test_a_background_write_only_where_a_core_is_left_for_it(monkeypatch):
    import evalsuite.observers.logits_file as logits_file

    logits = torch.zeros(2, 3)
    monkeypatch.setattr(logits_file, "usable_cores", lambda: 2)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert not core_left_for_writing(logits)  # both cores run the forward
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert core_left_for_writing(logits)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert core_left_for_writing(logits.to("meta"))  # on an accelerator the forward leaves the cores free
