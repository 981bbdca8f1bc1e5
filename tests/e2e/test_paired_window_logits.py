"""`PairedWindowLogits`: the candidate's `ppl` windows compared with the reference's as the model makes them,
on the tiny MiniCPM-V pair's real forwards: the same bits as the KLD detail of two stored observations, no
logits of the candidate on disk, a resumed observation that forwards only the windows it lacks, and the
refusals of a reference it cannot be paired with."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from evalsuite.backends.hf import HFBackend
from evalsuite.backends.options import BackendOptions
from evalsuite.contract.observation import Observation
from evalsuite.errors import InputError
from evalsuite.files.checkpoint import Checkpoint
from evalsuite.fixtures import TINY_BF16, TINY_W4A8
from evalsuite.observers.kld_detail import PAIR_ARRAYS, token_detail
from evalsuite.observers.paired_window_logits import PairedWindowLogits, is_paired, paired_detail
from evalsuite.observers.window_logits import RecordOptions, WindowLogits, WindowProtocol, tokens_sha256
from evalsuite.protocol.task import no_progress

PROTOCOL = WindowProtocol(
    window=64, starts={"first": 0, "step": 64, "count": 4}, scored={"first": 16, "last": 62}
)


def _inputs(vocab: int) -> dict:
    windows = np.random.default_rng(7).integers(0, vocab, size=(4, 64), dtype=np.int64)
    return {
        "windows": windows,
        "starts": [0, 64, 128, 192],
        "tokens_sha256": tokens_sha256(windows),
        "corpus": "ids",
        "n_tokens_text": 256,
    }


def _observe(path: Path, observer: WindowLogits, inputs: dict, folder: Path, key: str) -> Observation:
    folder.mkdir(parents=True, exist_ok=True)
    backend = HFBackend(Checkpoint.open(path), BackendOptions())
    try:
        obs = observer.observe(backend, inputs, folder, no_progress)
    finally:
        backend.close()
    obs.key = key
    obs.save(folder)
    return Observation.load(folder)


@pytest.fixture(scope="module")
def observed(tiny_pair, tmp_path_factory) -> dict:
    """The reference, the candidate stored whole (`WindowLogits`) and the candidate paired with the
    reference (`PairedWindowLogits`), each observed once."""
    root = tmp_path_factory.mktemp("paired")
    inputs = _inputs(500)  # ids within the tiny vocabulary of 512
    plain, paired = (
        WindowLogits(PROTOCOL, RecordOptions(), 8),
        PairedWindowLogits(PROTOCOL, RecordOptions(), 8),
    )
    ref = _observe(tiny_pair[TINY_BF16], plain, inputs, root / "ref", "ref-key")
    stored = _observe(tiny_pair[TINY_W4A8], plain, inputs, root / "stored", "stored-key")
    with_ref = {**inputs, "observed": {"ref": ref}}
    pair = _observe(tiny_pair[TINY_W4A8], paired, with_ref, root / "paired", "paired-key")
    return {"inputs": with_ref, "ref": ref, "stored": stored, "paired": pair, "root": root}


def test_a_paired_candidate_holds_the_detail_of_two_stored_sides_bit_for_bit(observed):
    ref, stored, pair = observed["ref"], observed["stored"], observed["paired"]
    assert is_paired(pair) and not is_paired(stored)
    assert not pair.files and not list((observed["root"] / "paired").glob("logits-*.npy"))
    assert stored.files  # the same candidate stored whole writes a file per window
    expected = token_detail(ref, stored, chunk_rows=8, precision="float32")
    got = paired_detail(ref, pair)
    for name in ("kld", "reverse_kld", "ref_top_p", "top_ref", "top_ckpt", "top_hits", "same_top"):
        a, b = getattr(got, name), getattr(expected, name)
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), name
    for name in ("nll", "top"):
        assert np.array_equal(pair.arrays[name], stored.arrays[name]), name
    # and therefore within the float32 path's bound of the float64 definition
    definition = token_detail(ref, stored, chunk_rows=8, precision="float64")
    assert abs(got.kld.mean() - definition.kld.mean()) <= max(1e-4 * definition.kld.mean(), 1e-9)
    # the candidate's log-normalisers gave its NLL and are not kept
    assert set(PAIR_ARRAYS) - {"ckpt_log_norm"} | {"nll", "top"} == set(pair.arrays)


def test_an_interrupted_paired_observation_forwards_only_the_windows_it_lacks(tiny_pair, observed, tmp_path):
    folder = tmp_path / "resumed"
    folder.mkdir()
    observer = PairedWindowLogits(PROTOCOL, RecordOptions(), 8)
    backend = HFBackend(Checkpoint.open(tiny_pair[TINY_W4A8]), BackendOptions())
    asked: list[list[int]] = []
    try:
        windows = torch.from_numpy(observed["inputs"]["windows"])

        def interrupted(todo: list[int]):
            asked.append(list(todo))
            for i, logits in enumerate(backend.window_logits(windows[todo], PROTOCOL.positions)):
                if i == 2:
                    raise KeyboardInterrupt
                yield logits

        def whole(todo: list[int]):
            asked.append(list(todo))
            yield from backend.window_logits(windows[todo], PROTOCOL.positions)

        with pytest.raises(KeyboardInterrupt):
            observer.observed(backend, observed["inputs"], folder, interrupted, lambda: None)
        assert sorted(p.name for p in folder.iterdir()) == [
            "window-0000.safetensors",
            "window-0001.safetensors",
        ]
        obs = observer.observed(backend, observed["inputs"], folder, whole, lambda: None)
    finally:
        backend.close()
    assert asked == [[0, 1, 2, 3], [2, 3]]
    assert not list(folder.iterdir())  # every window's part is in the observation's arrays
    for name, array in observed["paired"].arrays.items():
        assert obs.arrays[name].tobytes() == array.tobytes(), name


def test_a_reference_it_cannot_be_paired_with_is_refused(tiny_pair, observed, tmp_path):
    ref, pair = observed["ref"], observed["paired"]
    other = Observation(
        name=ref.name, key="another-reference", meta=ref.meta, arrays=ref.arrays, files=ref.files
    )
    with pytest.raises(InputError, match="compared with reference ref-key, not with this run's"):
        paired_detail(other, pair)
    # a reference observed on fewer windows than the candidate forwards
    fewer = {name: path for name, path in ref.files.items() if name != "window-0003"}
    short = Observation(name=ref.name, key=ref.key, meta=ref.meta, arrays=ref.arrays, files=fewer)
    observer = PairedWindowLogits(PROTOCOL, RecordOptions(), 8)
    with pytest.raises(InputError, match="reference's observation holds 3 windows"):
        _observe(tiny_pair[TINY_W4A8], observer, {**observed["inputs"], "observed": {"ref": short}},
                 tmp_path / "short", "k")  # fmt: skip


def test_against_a_recording_the_candidates_logits_are_stored_as_before(tiny_pair, observed, tmp_path):
    ref = observed["ref"]
    recorded = WindowLogits(PROTOCOL, RecordOptions(top_k=8, tail_samples=4), 8).record(ref, tmp_path)
    observer = PairedWindowLogits(PROTOCOL, RecordOptions(), 8)
    obs = _observe(
        tiny_pair[TINY_W4A8],
        observer,
        {**observed["inputs"], "observed": {"ref": recorded}},
        tmp_path / "c",
        "k",
    )
    assert not is_paired(obs) and len(obs.files) == 4
    assert np.array_equal(obs.arrays["nll"], observed["stored"].arrays["nll"])


def test_compared_beside_the_next_forward_the_observation_is_the_same(
    tiny_pair, observed, tmp_path, monkeypatch
):
    """Where a core is free (a GPU, or more cores than torch's threads) each window is compared in a thread
    beside the next forward: the same bytes as compared before it, as on this CPU."""
    from evalsuite.observers import paired_window_logits

    beside: list[bool] = []
    monkeypatch.setattr(
        paired_window_logits, "core_left_for_writing", lambda logits: beside.append(True) or True
    )
    observer = PairedWindowLogits(PROTOCOL, RecordOptions(), 8)
    obs = _observe(tiny_pair[TINY_W4A8], observer, observed["inputs"], tmp_path / "beside", "paired-key")
    assert beside == [True] * 4
    for name, array in observed["paired"].arrays.items():
        assert obs.arrays[name].tobytes() == array.tobytes(), name
