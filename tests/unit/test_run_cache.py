"""The disk cache of what a run computes from small files (`evalsuite.files.run_cache`): a corpus's ids under
a
tokenizer are read back instead of tokenized again, and only under the same tokenizer files, text and code;
the cache is kept under its cap, and `evalsuite cache` shows and clears it."""

import importlib.metadata
import json
import os
import time
from pathlib import Path

import numpy as np
import pytest

from evalsuite.backends.options import BackendOptions
from evalsuite.errors import InputError
from evalsuite.files import run_cache
from evalsuite.files.checkpoint import Checkpoint
from evalsuite.files.digest import DigestCache
from evalsuite.fixtures import TINY_BF16
from evalsuite.inputs.corpus import load_corpus
from evalsuite.observers.window_logits import WindowProtocol, prepare_windows
from evalsuite.protocol.side import open_side
from tests.conftest import copy_checkpoint, run_cli

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


def test_an_added_tokens_file_that_changes_the_ids_is_tokenized_again(tiny_pair, tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    monkeypatch.setenv("EVALSUITE_CACHE", str(tmp_path / "cache"))
    folder = copy_checkpoint(tiny_pair[TINY_BF16], tmp_path / "model")
    corpus = load_corpus("python-docs")
    first, _ = windows_of(folder, corpus)
    # Transformers reads added_tokens.json beside tokenizer.json: "assert" becomes a token of its own, the
    # vocabulary's next id.
    before = Checkpoint.open(folder).tokenizer_sha256
    (folder / "added_tokens.json").write_text(json.dumps({"assert": 512}))
    assert Checkpoint.open(folder).tokenizer_sha256 != before
    again, tokenized = windows_of(folder, corpus)
    assert tokenized
    fresh = AutoTokenizer.from_pretrained(str(folder))(corpus.text, add_special_tokens=False)["input_ids"]
    assert not np.array_equal(again, first)
    assert np.array_equal(again.ravel(), np.asarray(fresh)[: again.size])


@pytest.mark.parametrize("library", ["transformers", "tokenizers", "sentencepiece", "tiktoken", "protobuf"])
def test_another_version_of_a_library_that_tokenizes_is_another_key(library, tmp_path, monkeypatch):
    run_cache.code_versions.cache_clear()
    installed = run_cache.code_versions()
    # Another version of the library, found first on the path as an installed one would be.
    dist = tmp_path / "site" / f"{library.replace('-', '_')}-999.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {library}\nVersion: 999.0\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    run_cache.code_versions.cache_clear()
    try:
        assert importlib.metadata.version(library) == "999.0"
        assert run_cache.code_versions() != installed
    finally:
        monkeypatch.undo()
        run_cache.code_versions.cache_clear()
    assert run_cache.code_versions() == installed


def test_the_cache_is_kept_under_its_cap_least_recently_used_dropped_first(tmp_path, monkeypatch):
    monkeypatch.setenv("EVALSUITE_CACHE", str(tmp_path / "cache"))
    cache = run_cache.RunCache("tokens")
    ids = np.arange(100, dtype=np.int64)  # 928 bytes as .npy
    keys = {name: {"corpus": name} for name in "abcde"}

    def entry(name: str) -> Path:
        return cache._path(keys[name], ".npy")

    for name in "abc":
        cache.put_tokens(keys[name], ids)
    entry_bytes = entry("a").stat().st_size
    monkeypatch.setenv("EVALSUITE_CACHE_MAX_MB", str(3.5 * entry_bytes / 1e6))  # room for three
    # Their last uses set apart (a write or a read is a use), then `a` read: `b` is the least recently used.
    now = time.time_ns()
    for age, name in zip((300, 200, 100), "abc", strict=True):
        os.utime(entry(name), ns=(now - age * 10**9, now - age * 10**9))
    assert np.array_equal(cache.tokens(keys["a"]), ids)
    cache.put_tokens(keys["d"], ids)
    assert sorted(p.name for p in (tmp_path / "cache" / "tokens").iterdir()) == sorted(
        entry(name).name for name in "acd"
    )
    # A load plan's mark (of about an entry's size here) counts under the same cap: `c`, now the least
    # recently used, goes.
    run_cache.RunCache("load-plans").put_passed({"plan": "x" * entry_bytes})
    assert not entry("c").exists() and entry("a").exists() and entry("d").exists()
    on_disk = [p for kind in ("tokens", "load-plans") for p in (tmp_path / "cache" / kind).iterdir()]
    assert sum(p.stat().st_size for p in on_disk) <= 3.5 * entry_bytes


def test_a_cap_that_is_not_a_size_is_refused_naming_the_variable(monkeypatch):
    monkeypatch.setenv("EVALSUITE_CACHE_MAX_MB", "lots")
    with pytest.raises(InputError, match="EVALSUITE_CACHE_MAX_MB='lots' is not a size in megabytes"):
        run_cache.max_cache_bytes()


def test_evalsuite_cache_shows_and_clears_all_but_the_fixtures(tiny_pair, tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("EVALSUITE_CACHE", str(root))
    windows_of(tiny_pair[TINY_BF16], load_corpus("python-docs"))  # a corpus's ids, and the files' digests
    run_cache.RunCache("load-plans").put_passed({"plan": "x"})
    DigestCache.default().sha256(tiny_pair[TINY_BF16] / "config.json")
    fixtures = tmp_path / "fixtures"
    (fixtures / "a-fixture").mkdir(parents=True)
    (fixtures / "a-fixture" / "model.safetensors").write_bytes(b"\0" * 1000)
    env = {"EVALSUITE_CACHE": str(root)}

    def shown(*args: str) -> dict[str, list[str]]:
        res = run_cli("cache", "--fixtures", fixtures, *args, env=env)
        assert res.returncode == 0, res.stderr
        return {line.split("\t")[0]: line.split("\t")[1:] for line in res.stdout.splitlines()}

    tokens = next((root / "tokens").iterdir())
    listed = shown()
    assert listed["tokens"] == ["1 entries", f"{tokens.stat().st_size:,} bytes", str(root / "tokens")]
    assert listed["load-plans"][0] == "1 entries" and listed["digests"][0] == "1 entries"
    assert listed["fixtures"] == ["1 entries", "1,000 bytes", str(fixtures)]

    cleared = shown("--clear")
    assert cleared["tokens"] == [*listed["tokens"], "removed"]
    assert [cleared[k][-1] for k in ("load-plans", "digests", "fixtures")] == ["removed", "removed", "kept"]
    assert [list((root / kind).iterdir()) for kind in ("tokens", "load-plans", "digests")] == [[], [], []]
    assert (fixtures / "a-fixture" / "model.safetensors").stat().st_size == 1000
    assert [shown()[k][0] for k in ("tokens", "load-plans", "digests", "fixtures")] == [
        "0 entries", "0 entries", "0 entries", "1 entries"
    ]  # fmt: skip


def test_a_gguf_s_ids_are_read_back_under_the_same_file_only(smollm2_pair, tmp_path, monkeypatch):
    """Transformers rebuilds a GGUF file's tokenizer from its vocabulary each time (seconds for SmolLM2's):
    the ids are kept under the file's digest, and a file whose bytes changed is tokenized again."""
    import shutil

    from evalsuite.fixtures.smollm2 import smollm2_gguf_path
    from tests.conftest import FIXTURES

    monkeypatch.setenv("EVALSUITE_CACHE", str(tmp_path / "cache"))
    (tmp_path / "pack").mkdir()
    pack = Path(shutil.copy(smollm2_gguf_path(FIXTURES), tmp_path / "pack"))
    corpus = load_corpus("python-docs")
    first, tokenized = windows_of(pack.parent, corpus)
    assert tokenized
    again, tokenized = windows_of(pack.parent, corpus)
    assert not tokenized and np.array_equal(first, again)

    with pack.open("r+b") as f:  # the last weight byte: the same vocabulary, other bytes
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 1]))
    _, tokenized = windows_of(pack.parent, corpus)
    assert tokenized
