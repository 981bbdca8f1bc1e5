"""The disk cache of what a run computes from small files (`evalsuite.run_cache`): a corpus's ids under a
tokenizer are read back instead of tokenized again, and only under the same tokenizer files, text and code."""

import json

import numpy as np

from evalsuite import run_cache
from evalsuite.backends.options import BackendOptions
from evalsuite.corpus import load_corpus
from evalsuite.fixtures import TINY_BF16
from evalsuite.side import open_side
from evalsuite.tasks.window_logits import WindowProtocol, prepare_windows
from tests.conftest import copy_checkpoint

PROTOCOL = WindowProtocol(window=64, starts={"first": 0, "step": 64, "count": 2})


def windows_of(folder, corpus) -> tuple[np.ndarray, bool]:
    """The prepared windows of a fresh side (a new process's), and whether its tokenizer was loaded."""
    side = open_side("ref", str(folder), BackendOptions())
    inputs = prepare_windows(PROTOCOL, corpus, side, side)
    return inputs["windows"], side._tokenizer is not None


def test_token_ids_are_read_back_under_the_same_files_and_code_only(tiny_pair, tmp_path, monkeypatch):
    monkeypatch.setenv("EVALSUITE_CACHE", str(tmp_path / "cache"))
    folder = copy_checkpoint(tiny_pair[TINY_BF16], tmp_path / "model")
    corpus = load_corpus("python-docs")
    first, tokenized = windows_of(folder, corpus)
    assert tokenized
    again, tokenized = windows_of(folder, corpus)
    assert not tokenized and np.array_equal(first, again)
    assert len(list((tmp_path / "cache" / "tokens").glob("*.npy"))) == 1

    # Another tokenizer file: tokenized again, under its own key.
    config = folder / "tokenizer_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "model_max_length": 4096}))
    _, tokenized = windows_of(folder, corpus)
    assert tokenized
    # Another evalsuite or library version: tokenized again.
    monkeypatch.setattr(run_cache, "code_versions", lambda: "another Transformers")
    _, tokenized = windows_of(folder, corpus)
    assert tokenized
    assert len(list((tmp_path / "cache" / "tokens").glob("*.npy"))) == 3


def test_a_damaged_cache_entry_is_tokenized_again(tiny_pair, tmp_path, monkeypatch):
    monkeypatch.setenv("EVALSUITE_CACHE", str(tmp_path / "cache"))
    corpus = load_corpus("python-docs")
    first, _ = windows_of(tiny_pair[TINY_BF16], corpus)
    (entry,) = (tmp_path / "cache" / "tokens").glob("*.npy")
    entry.write_bytes(entry.read_bytes()[:100])
    again, tokenized = windows_of(tiny_pair[TINY_BF16], corpus)
    assert tokenized and np.array_equal(first, again)
