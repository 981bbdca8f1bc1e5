"""`token_detail`: the per-token KLD detail of two live observations, read from their logits files, and the
reference's rows it keeps for the next candidate compared against the same reference."""

import numpy as np
import pytest
import torch

from evalsuite import metrics
from evalsuite.observation import Observation
from evalsuite.tasks import kld_detail
from evalsuite.tasks.logits_file import window_file, write_window_chunks
from evalsuite.tasks.window_logits import log_softmax64


def _observation(folder, windows: list[torch.Tensor], key: str) -> Observation:
    folder.mkdir()
    for w, rows in enumerate(windows):
        write_window_chunks(folder, w, len(rows), iter([rows]))
    files = {f"window-{w:04d}": window_file(folder, w) for w in range(len(windows))}
    return Observation(name="window-logits", key=key, meta={"n_windows": len(windows)}, files=files)


def _by_definition(ref: list[torch.Tensor], ckpt: list[torch.Tensor]) -> dict[str, np.ndarray]:
    """Every statistic straight from its definition, the whole of each side at once."""
    x, y = torch.cat(ref), torch.cat(ckpt)
    lp_ref, lp_ckpt = log_softmax64(x), log_softmax64(y)
    top = lp_ref.topk(kld_detail.TOP_K_AGREEMENT, dim=-1)
    return {
        "ref_top_p": top.values[:, 0].exp().numpy(),
        "top_ref": top.indices.numpy(),
        "top_ckpt": y.double().topk(kld_detail.TOP_K_AGREEMENT, dim=-1).indices.numpy(),
        "kld": metrics.kl_divergence(lp_ref.numpy(), lp_ckpt.numpy()),
        "reverse_kld": metrics.kl_divergence(lp_ckpt.numpy(), lp_ref.numpy()),
    }


@pytest.fixture
def three_torch_threads():
    """Room for up to three threads of `token_detail` (it never takes more than torch's own count)."""
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_token_detail_is_the_same_bits_for_the_first_candidate_and_the_next(
    tmp_path, monkeypatch, three_torch_threads, threads
):
    monkeypatch.setattr(kld_detail, "_REFERENCE_ROWS", {})
    monkeypatch.setattr(kld_detail, "DETAIL_THREADS", threads)  # windows split between threads
    monkeypatch.setattr(kld_detail, "CACHE_BYTES", 3 * 8 * 1000)  # 3 rows at a time: blocks split unevenly
    torch.manual_seed(0)
    ref = [(torch.randn(n, 1000) * 4).to(torch.bfloat16) for n in (11, 6)]
    ckpt = [(x.float() + torch.randn_like(x.float()) * 0.3).to(torch.bfloat16) for x in ref]
    other = [(x.float() + torch.randn_like(x.float()) * 0.5).to(torch.bfloat16) for x in ref]
    r = _observation(tmp_path / "ref", ref, "ref-key")
    a, b = _observation(tmp_path / "a", ckpt, "a-key"), _observation(tmp_path / "b", other, "b-key")
    first = kld_detail.token_detail(r, a, chunk_rows=4)
    assert kld_detail._REFERENCE_ROWS["ref-key"].rebuildable  # this torch's log-softmax is (x − max) − log Σ
    again, second = kld_detail.token_detail(r, a, chunk_rows=4), kld_detail.token_detail(r, b, chunk_rows=5)
    for detail, sides in ((first, ckpt), (again, ckpt), (second, other)):
        for name, expected in _by_definition(ref, sides).items():
            got = getattr(detail, name)
            assert got.dtype == expected.dtype and got.tobytes() == expected.tobytes(), name
    assert torch.get_num_threads() == 3  # torch's own thread count is the caller's again


def test_a_reference_without_a_key_is_never_kept(tmp_path, monkeypatch):
    monkeypatch.setattr(kld_detail, "_REFERENCE_ROWS", {})
    rows = [torch.randn(3, 50).to(torch.bfloat16)]
    r, a = _observation(tmp_path / "ref", rows, ""), _observation(tmp_path / "a", rows, "a-key")
    detail = kld_detail.token_detail(r, a, chunk_rows=2)
    assert not kld_detail._REFERENCE_ROWS
    assert np.all(detail.kld == 0.0) and not np.signbit(detail.reverse_kld).any()
