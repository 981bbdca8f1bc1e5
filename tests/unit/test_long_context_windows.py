"""Long-context `ppl` pieces without a model: position buckets worked by hand, the spec section, the scored
positions' default, and the chunked logits file."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from evalsuite.errors import InputError
from evalsuite.observers.logits_file import read_rows, window_file, write_window_chunks
from evalsuite.observers.window_logits import WindowProtocol
from evalsuite.stats import metrics
from evalsuite.tasks.long_context import LongContext, position_bucket_metrics


def test_position_buckets_split_by_edges_and_name_their_ranges():
    positions = np.array([0, 5, 1023, 1024, 4095, 4096, 20000])
    buckets = metrics.position_buckets(positions, [0, 1024, 4096, 16384])
    assert [name for name, _ in buckets] == ["pos_0_1k", "pos_1k_4k", "pos_4k_16k", "pos_16k_inf"]
    assert [list(positions[mask]) for _, mask in buckets] == [[0, 5, 1023], [1024, 4095], [4096], [20000]]
    # An empty bucket is left out; an edge that is no multiple of 1,024 is named in tokens.
    assert [name for name, _ in metrics.position_buckets(positions[:3], [0, 100, 4096])] == [
        "pos_0_100",
        "pos_100_4k",
    ]


def test_bucket_metrics_are_those_of_the_buckets_tokens():
    positions = np.array([0, 1, 2, 3])
    kld = np.array([0.0, 0.2, 0.4, 0.6])
    nll_ref = np.log(np.array([2.0, 2.0, 4.0, 4.0]))  # p_ref = 0.5, 0.5, 0.25, 0.25
    nll_ckpt = np.log(np.array([2.0, 4.0, 4.0, 2.0]))
    same = np.array([True, False, True, True])
    m = position_bucket_metrics([0, 2], positions, kld, same, nll_ref, nll_ckpt)
    assert m["pos_0_2_n_tokens"] == 2 and m["pos_2_inf_n_tokens"] == 2
    assert m["pos_0_2_kld_mean"] == pytest.approx(0.1) and m["pos_2_inf_kld_mean"] == pytest.approx(0.5)
    assert m["pos_0_2_same_top_p"] == 0.5 and m["pos_2_inf_same_top_p"] == 1.0
    assert m["pos_0_2_delta_p_mean"] == pytest.approx(-0.125)  # (0 + (0.25 − 0.5)) / 2
    assert m["pos_2_inf_ln_ppl_ratio"] == pytest.approx((0 + np.log(0.5)) / 2)


def test_bucket_errors_are_clustered_by_window():
    # Two windows of 4 tokens, positions 0..3 in each; bucket [0, 2) holds tokens 0, 1 of each window.
    positions = np.tile(np.arange(4), 2)
    windows = np.repeat([0, 1], 4)
    kld = np.array([0.1, 0.3, 1.0, 1.0, 0.5, 0.7, 1.0, 1.0])
    nll = np.full(8, 1.0)
    same = np.array([True, True, True, True, False, True, True, True])
    m = position_bucket_metrics([0, 2], positions, kld, same, nll, nll, windows=windows)
    # The bucket's window means are 0.2 and 0.6: the clustered error is that of 2 cluster means.
    bucket = kld[[0, 1, 4, 5]]
    assert m["pos_0_2_kld_mean_stderr_window"] == pytest.approx(
        metrics.clustered_stderr(bucket, windows[[0, 1, 4, 5]])
    )
    assert m["pos_0_2_kld_mean_stderr_window"] == pytest.approx(np.std([0.2, 0.6], ddof=1) / np.sqrt(2))
    assert "pos_2_inf_same_top_p_stderr_window" in m and "pos_0_2_rms_delta_p_stderr_window" in m
    # One window: no clustered error at all.
    one = position_bucket_metrics([0, 2], positions, kld, same, nll, nll, windows=np.zeros(8, dtype=int))
    assert np.isnan(one["pos_0_2_kld_mean_stderr_window"])


def test_the_long_context_section_is_validated():
    assert LongContext() == LongContext(head_chunk_rows=0, position_buckets=[], every_window=False)
    for bad in ({"head_chunk_rows": -1}, {"position_buckets": [0, 4096, 1024]}, {"position_buckets": [-1]}):
        with pytest.raises(ValidationError):
            LongContext(**bad)


def test_scored_positions_default_to_the_second_half_of_the_window():
    assert WindowProtocol().scored.first == 256 and WindowProtocol().scored.last == 510  # as before
    long = WindowProtocol(window=8192, starts={"first": 0, "step": 8192, "count": 1})
    assert (long.scored.first, long.scored.last) == (4096, 8190)


def test_a_window_file_written_in_chunks_reads_back_as_one(tmp_path):
    rows = torch.randn(10, 7).to(torch.bfloat16)
    write_window_chunks(tmp_path, 0, 10, iter([rows[:4], rows[4:8], rows[8:]]))
    assert torch.equal(torch.cat([b.clone() for b in read_rows([window_file(tmp_path, 0)], 3)]), rows)
    with pytest.raises(InputError, match="returned 8 logit rows for window 1, expected 10"):
        write_window_chunks(tmp_path, 1, 10, iter([rows[:4], rows[4:8]]))
    assert not window_file(tmp_path, 1).exists() and not list(tmp_path.glob("*.tmp"))
