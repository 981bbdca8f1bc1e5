"""`token_detail`: the per-token KLD detail of two live observations, read from their logits files, and the
reference's rows it keeps for the next candidate compared against the same reference."""

import numpy as np
import pytest
import torch

from evalsuite.contract.observation import Observation
from evalsuite.observers import kld_detail
from evalsuite.observers.logits_file import window_file, write_window_chunks
from evalsuite.observers.window_logits import log_softmax64
from evalsuite.protocol.task import SharedWork
from evalsuite.stats import metrics, token_ranks


def _observation(folder, windows: list[torch.Tensor], key: str) -> Observation:
    folder.mkdir()
    for w, rows in enumerate(windows):
        write_window_chunks(folder, w, len(rows), iter([rows]))
    files = {f"window-{w:04d}": window_file(folder, w) for w in range(len(windows))}
    return Observation(name="window-logits", key=key, meta={"n_windows": len(windows)}, files=files)


def _ranked(rows: np.ndarray, k: int) -> np.ndarray:
    """Each row's k largest ids, largest first, equal values by lower id: a sort of the whole row."""
    return np.stack([np.lexsort((np.arange(len(row)), -row))[:k] for row in rows])


def _by_definition(ref: list[torch.Tensor], ckpt: list[torch.Tensor]) -> dict[str, np.ndarray]:
    """Every statistic straight from its definition, the whole of each side at once."""
    x, y = torch.cat(ref), torch.cat(ckpt)
    lp_ref, lp_ckpt = log_softmax64(x), log_softmax64(y)
    return {
        "ref_top_p": lp_ref.amax(dim=-1).exp().numpy(),
        "top_ref": _ranked(lp_ref.numpy(), kld_detail.TOP_K_AGREEMENT),
        "top_ckpt": _ranked(y.double().numpy(), kld_detail.TOP_K_AGREEMENT),
        "kld": metrics.kl_divergence(lp_ref.numpy(), lp_ckpt.numpy()),
        "reverse_kld": metrics.kl_divergence(lp_ckpt.numpy(), lp_ref.numpy()),
    }


@pytest.fixture
def three_torch_threads():
    """torch at three intra-op threads, the test's own setting, to see that the detail leaves it alone."""
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    yield
    torch.set_num_threads(before)


def _sides(seed: int = 0) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    torch.manual_seed(seed)
    ref = [(torch.randn(n, 1000) * 4).to(torch.bfloat16) for n in (11, 6)]
    ckpt = [(x.float() + torch.randn_like(x.float()) * 0.3).to(torch.bfloat16) for x in ref]
    other = [(x.float() + torch.randn_like(x.float()) * 0.5).to(torch.bfloat16) for x in ref]
    return ref, ckpt, other


def test_float64_is_the_definition_bit_for_bit_for_the_first_candidate_and_the_next(tmp_path, monkeypatch):
    monkeypatch.setattr(kld_detail, "CACHE_BYTES", 3 * 8 * 1000)  # 3 rows at a time: blocks split unevenly
    ref, ckpt, other = _sides()
    r = _observation(tmp_path / "ref", ref, "ref-key")
    a, b = _observation(tmp_path / "a", ckpt, "a-key"), _observation(tmp_path / "b", other, "b-key")
    shared = SharedWork()
    first = kld_detail.token_detail(r, a, chunk_rows=4, precision="float64", shared=shared)
    kept = shared.find(("reference-rows", "ref-key"))
    assert kept is not None and kept.rebuildable  # this torch's log-softmax is (x − max) − log Σ
    again = kld_detail.token_detail(r, a, chunk_rows=4, precision="float64", shared=shared)
    second = kld_detail.token_detail(r, b, chunk_rows=5, precision="float64", shared=shared)
    for detail, sides in ((first, ckpt), (again, ckpt), (second, other)):
        for name, expected in _by_definition(ref, sides).items():
            got = getattr(detail, name)
            assert got.dtype == expected.dtype and got.tobytes() == expected.tobytes(), name


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_float32_keeps_the_definition_within_its_bound_and_leaves_torch_threads_alone(
    tmp_path, monkeypatch, three_torch_threads, threads
):
    monkeypatch.setattr(kld_detail, "DETAIL_THREADS", threads)  # windows split between threads
    monkeypatch.setattr(kld_detail, "FLOAT32_BLOCK_BYTES", 3 * 16 * 1000)  # 3 rows at a time
    ref, ckpt, _ = _sides()
    r, a = _observation(tmp_path / "ref", ref, "ref-key"), _observation(tmp_path / "a", ckpt, "a-key")
    detail = kld_detail.token_detail(r, a, chunk_rows=4)
    expected = _by_definition(ref, ckpt)
    for name in ("top_ref", "top_ckpt"):  # ids: exactly the definition's, ties in the same order
        assert np.array_equal(getattr(detail, name), expected[name]), name
    for name in ("kld", "reverse_kld", "ref_top_p"):
        got, want = getattr(detail, name), expected[name]
        assert got.dtype == np.float64
        # Each per-token figure to 1e-5 of its own size plus 1e-9: float32 exp's rounding, not the logits'.
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-9, err_msg=name)
    lp_ref, lp_ckpt = (log_softmax64(torch.cat(rows)).numpy() for rows in (ref, ckpt))
    assert np.array_equal(detail.same_top, token_ranks.same_top_tied(lp_ref, lp_ckpt))
    assert torch.get_num_threads() == 3  # torch's thread count is the caller's, never changed


def test_float32_gives_the_same_bits_whatever_the_threads_and_blocks(tmp_path, monkeypatch):
    ref, ckpt, _ = _sides(1)
    r, a = _observation(tmp_path / "ref", ref, "ref-key"), _observation(tmp_path / "a", ckpt, "a-key")
    runs = []
    for threads, rows in ((1, 1), (2, 3), (3, 7)):
        monkeypatch.setattr(kld_detail, "DETAIL_THREADS", threads)
        monkeypatch.setattr(kld_detail, "FLOAT32_BLOCK_BYTES", rows * 16 * 1000)
        runs.append(kld_detail.token_detail(r, a, chunk_rows=5))
    for other in runs[1:]:
        for name in ("kld", "reverse_kld", "ref_top_p", "top_ref", "top_ckpt", "same_top"):
            assert getattr(other, name).tobytes() == getattr(runs[0], name).tobytes(), name


def test_float32_detail_runs_a_thread_per_usable_core_at_most_one_per_window(monkeypatch):
    monkeypatch.setattr(kld_detail, "usable_cores", lambda: 16)  # a GPU host's CPU, say
    assert [kld_detail.detail_threads(w) for w in (1, 8, 40)] == [1, 8, 16]
    monkeypatch.setattr(kld_detail, "usable_cores", lambda: 2)
    assert [kld_detail.detail_threads(w) for w in (1, 8)] == [1, 2]
    monkeypatch.setattr(kld_detail, "DETAIL_THREADS", 3)  # set by hand, it wins
    assert kld_detail.detail_threads(8) == 3


def test_float32_blocks_share_the_largest_cache_between_the_usable_cores_halved(monkeypatch):
    mib = 1 << 20
    monkeypatch.setattr(kld_detail, "usable_cores", lambda: 2)
    monkeypatch.setattr(kld_detail, "largest_cache_bytes", lambda: 32 * mib)  # a 2-core EPYC slice's L3
    assert kld_detail.float32_block_bytes() == 8 * mib
    monkeypatch.setattr(kld_detail, "largest_cache_bytes", lambda: 105 * mib)  # larger: at most 16 MiB
    assert kld_detail.float32_block_bytes() == 16 * mib
    monkeypatch.setattr(kld_detail, "usable_cores", lambda: 16)  # many threads: never below 4 MiB
    assert kld_detail.float32_block_bytes() == 4 * mib
    monkeypatch.setattr(kld_detail, "largest_cache_bytes", lambda: None)  # not known
    assert kld_detail.float32_block_bytes() == 8 * mib
    monkeypatch.setattr(kld_detail, "FLOAT32_BLOCK_BYTES", 3 * mib)  # set by hand, it wins
    assert kld_detail.float32_block_bytes() == 3 * mib


def test_float32_rows_of_infinite_logits_fall_back_to_the_definition(tmp_path):
    ref = torch.randn(4, 50) * 3
    ckpt = ref + torch.randn(4, 50) * 0.2
    ref[1, 7] = float("-inf")  # a token the reference rules out: its term is 0
    ckpt[2, 3] = float("-inf")  # one the candidate rules out but the reference does not: KL is infinite
    ref[3, :] = float("-inf")
    ckpt[3, :] = float("-inf")  # a row of no distribution at all: the definition's masked terms sum to 0
    r = _observation(tmp_path / "ref", [ref.to(torch.bfloat16)], "ref-key")
    a = _observation(tmp_path / "a", [ckpt.to(torch.bfloat16)], "a-key")
    detail = kld_detail.token_detail(r, a, chunk_rows=4)
    lp_ref, lp_ckpt = (log_softmax64(x.to(torch.bfloat16)).numpy() for x in (ref, ckpt))
    with np.errstate(invalid="ignore"):
        want = metrics.kl_divergence(lp_ref, lp_ckpt)
    np.testing.assert_allclose(detail.kld, want, rtol=1e-6)
    assert np.isinf(detail.kld[2]) and np.isfinite(detail.kld[[0, 1, 3]]).all()


def test_a_reference_without_a_key_is_never_kept(tmp_path):
    rows = [torch.randn(3, 50).to(torch.bfloat16)]
    r, a = _observation(tmp_path / "ref", rows, ""), _observation(tmp_path / "a", rows, "a-key")
    shared = SharedWork()
    for precision in ("float32", "float64"):
        detail = kld_detail.token_detail(r, a, chunk_rows=2, precision=precision, shared=shared)
        assert not len(shared)
        assert np.all(detail.kld == 0.0) and np.all(detail.reverse_kld == 0.0), precision
