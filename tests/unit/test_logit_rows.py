"""`logit_rows.row_scores`: one side's NLL and top token in the float32 detail's arithmetic, against the
float64 definition, and bit for bit what `pair_statistics` gives the same rows as the candidate's."""

import numpy as np
import torch

from evalsuite.observers.window_logits import numpy_rows
from evalsuite.stats import logit_rows


def _rows(dtype: torch.dtype, n: int = 12, vocab: int = 3000) -> torch.Tensor:
    generator = torch.Generator().manual_seed(7)
    return (torch.randn(n, vocab, generator=generator) * 4 + 20).to(dtype)  # far from 0: shifts matter


def _scores(rows: torch.Tensor, targets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return logit_rows.row_scores(numpy_rows(rows), targets, logit_rows.RowScratch(*rows.shape))


def test_nll_and_top_keep_the_float64_definition_for_every_stored_dtype():
    targets = np.arange(12) * 97 % 3000
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        rows = _rows(dtype)
        nll, top = _scores(rows, targets)
        definition = -torch.log_softmax(rows.double(), dim=-1)[torch.arange(12), targets].numpy()
        assert nll.dtype == np.float64
        np.testing.assert_allclose(nll, definition, rtol=0, atol=1e-6)
        # the most probable token, equal values by lower id
        by_definition = [int(np.flatnonzero(row == row.max())[0]) for row in rows.float().numpy()]
        assert top.tolist() == by_definition, dtype


def test_ties_go_to_the_lower_id_and_a_nan_is_never_the_top():
    rows = torch.zeros(3, 50)
    rows[0, [9, 4]] = 5.0  # tied maximum: the lower id
    rows[1, 2] = float("nan")
    rows[1, 30] = 1.0
    rows[2, 7] = float("-inf")  # the target ruled out: an infinite NLL
    nll, top = _scores(rows, np.array([4, 30, 7]))
    assert top.tolist() == [4, 30, 0]
    assert np.isnan(nll[1]) and np.isinf(nll[2]) and np.isfinite(nll[0])


def test_the_same_bits_as_the_candidates_log_normaliser_in_a_pair():
    ref, ckpt = _rows(torch.bfloat16), (_rows(torch.float32) + 0.3).to(torch.bfloat16)
    targets = np.arange(12) * 31 % 3000
    nll, top = _scores(ckpt, targets)
    scratch = logit_rows.RowScratch(5, 3000)  # other blocks than row_scores had: the same bits per row
    pairs = [
        logit_rows.pair_statistics(numpy_rows(ref[i : i + 5]), numpy_rows(ckpt[i : i + 5]), 5, scratch)
        for i in range(0, 12, 5)
    ]
    log_norm = np.concatenate([p.ckpt_log_norm for p in pairs])
    paired_nll = log_norm - ckpt.double().numpy()[np.arange(12), targets]
    assert paired_nll.tobytes() == nll.tobytes()
    assert np.concatenate([p.top_ckpt[:, 0] for p in pairs]).tolist() == top.tolist()
