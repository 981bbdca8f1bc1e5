"""`--corpus-path`: WikiText-2's raw test split from a local copy (parquet, a `save_to_disk` folder,
wiki.test.raw), recognised by its shape and first article, joined as the seed card says; anything else is
refused naming the file and what differs. `auto` says why it fell back. The tables are synthetic, in the
split's schema and shape: no copy of WikiText-2 can be had offline."""

from __future__ import annotations

import hashlib
import os
import socket
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from evalsuite.errors import DependencyError, InputError
from evalsuite.inputs import corpus as corpus_module
from evalsuite.inputs.corpus import (
    PYTHON_DOCS,
    WIKITEXT2,
    WIKITEXT2_TEST_ROWS,
    load_corpus,
    python_docs_text,
    wikitext2_from_path,
    wikitext2_test_text,
)
from evalsuite.protocol.task import RunContext
from evalsuite.tasks.ppl import corpus_provenance


def split_rows(n: int = WIKITEXT2_TEST_ROWS, first_article: str = " = Robert Boulter = ") -> list[str]:
    """Rows shaped like wikitext-2-raw-v1 test as `datasets` serves it: an empty row, the first article's
    heading, then lines (each with its newline) between empty rows; the filler is English prose."""
    prose = [line for line in python_docs_text().splitlines() if line.strip()]
    rows = ["", f"{first_article}\n", ""]
    while len(rows) < n:
        rows += [f" {prose[len(rows) % len(prose)]}\n", ""]
    return rows[:n]


def write_parquet(path: Path, rows: list[str], column: str = "text") -> Path:
    pq.write_table(pa.table({column: rows}), path)
    return path


def joined_sha256(rows: list[str]) -> str:
    return hashlib.sha256("\n".join(rows).encode("utf-8")).hexdigest()


def test_parquet_save_to_disk_and_raw_copies_give_the_same_reconstruction(tmp_path):
    import datasets

    rows = split_rows()
    parquet = write_parquet(tmp_path / "test-00000-of-00001.parquet", rows)
    saved = tmp_path / "saved"
    datasets.Dataset.from_dict({"text": rows}).save_to_disk(str(saved))
    saved_dict = tmp_path / "saved-dict"
    datasets.DatasetDict({"test": datasets.Dataset.from_dict({"text": rows})}).save_to_disk(str(saved_dict))
    # wiki.test.raw: one line per row, the blank lines holding a space, as the original archive has them.
    raw = tmp_path / "wiki.test.raw"
    raw.write_text("".join(row if row else " \n" for row in rows), encoding="utf-8")
    texts = {p.name: wikitext2_from_path(p) for p in (parquet, saved, saved_dict, raw)}
    assert set(texts.values()) == {"\n".join(rows)}
    got = load_corpus("auto", corpus_path=parquet)
    assert got.name == WIKITEXT2 and got.sha256 == joined_sha256(rows) and got.fallback is None
    assert got.source == f"local copy {parquet}"


@pytest.mark.parametrize(
    ("rows", "column", "what"),
    [
        (split_rows(), "content", "no `text` column (columns: content)"),
        (split_rows(4000), "text", "4,000 rows, the split has 4,358"),
        (split_rows(first_article=" = Valkyria Chronicles III = "), "text", "its first article is ' = Valk"),
    ],
    ids=["wrong-column", "truncated", "another-text"],
)
def test_a_copy_that_is_not_the_split_is_refused_naming_the_file_and_what_differs(
    tmp_path, rows, column, what
):
    path = write_parquet(tmp_path / "copy.parquet", rows, column)
    with pytest.raises(InputError) as refused:
        load_corpus("wikitext-2-raw-v1", corpus_path=path)
    assert str(refused.value).startswith(f"{path}: ") and what in str(refused.value), refused.value


def test_corpus_path_is_refused_beside_another_text(tmp_path):
    with pytest.raises(InputError, match="cannot be combined with --corpus python-docs"):
        load_corpus(PYTHON_DOCS, corpus_path=tmp_path / "x.parquet")
    with pytest.raises(InputError, match="does not exist"):
        load_corpus("auto", corpus_path=tmp_path / "x.parquet")


def test_auto_says_why_it_fell_back(monkeypatch):
    def unavailable(*, allow_download: bool = False) -> str:
        raise DependencyError("WikiText-2 is not available (not in the local cache): DatasetNotFoundError")

    monkeypatch.setattr(corpus_module, "wikitext2_test_text", unavailable)
    values = corpus_provenance(RunContext(corpus_name="auto"))
    assert values["corpus_fallback"] == (
        "auto: WikiText-2 is not available (not in the local cache): DatasetNotFoundError"
    )
    assert values["corpus_sha256"] == hashlib.sha256(python_docs_text().encode()).hexdigest()
    assert "corpus_fallback" not in corpus_provenance(RunContext(corpus_name=PYTHON_DOCS))


def test_wikitext2_not_in_the_cache_never_reaches_the_network_with_the_hub_imported(monkeypatch, tmp_path):
    # Imported first, as in any process that loaded a model before the corpus: their offline switches were
    # read then, with the variable unset, so only the module constants can keep them off the network.
    import datasets.config
    import huggingface_hub.constants

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    # empty caches: a machine that has WikiText-2 cached would otherwise read it
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    attempts: list[object] = []

    def refuse(address: object, *args: object, **kwargs: object) -> None:
        attempts.append(address)
        raise OSError("no network in this test")

    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket.socket, "connect", lambda self, address: refuse(address))
    with pytest.raises(DependencyError, match="not in the local cache"):
        wikitext2_test_text()
    assert attempts == []
    # and the switches are the caller's again afterwards
    assert huggingface_hub.constants.HF_HUB_OFFLINE is False and datasets.config.HF_HUB_OFFLINE is False
    assert "HF_HUB_OFFLINE" not in os.environ
