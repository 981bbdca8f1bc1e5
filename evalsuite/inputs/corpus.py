"""The text the `ppl` protocol scores: WikiText-2 (through `datasets`, or a local copy of its test split), a
user's file, or an offline corpus.

No data set can be fetched on CI or on air-gapped machines, so evalsuite also assembles an English corpus from
text that every CPython install carries: the Python Language Reference topics in `pydoc_data.topics`. It is
deterministic for a given Python version, and the report names the corpus and hashes its tokens, so two runs
on different corpora can never be compared by accident.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from evalsuite.errors import DependencyError, InputError
from evalsuite.inputs.offline import hub_offline

WIKITEXT2 = "wikitext-2-raw-v1"
PYTHON_DOCS = "python-docs"
CORPORA = ("auto", WIKITEXT2, PYTHON_DOCS)
# What identifies the raw test split of wikitext-2-raw-v1 as `datasets` serves it (one row per line of
# wiki.test.raw, blank lines as empty rows). No trustworthy published digest of the joined text exists, so
# the split is recognised by its shape and its first article, and the join's sha256 is recorded, not checked.
WIKITEXT2_TEST_ROWS = 4358
WIKITEXT2_FIRST_ARTICLE = " = Robert Boulter = "


@dataclass(frozen=True)
class Corpus:
    """A named text: `name` says what it is, `sha256` hashes its UTF-8 bytes, `source` where it was read
    from, and `fallback` why `auto` did not take WikiText-2 (None when it did, or was not asked to choose)."""

    name: str
    text: str
    source: str | None = None
    fallback: str | None = None

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode("utf-8")).hexdigest()


def python_docs_text() -> str:
    """The offline English corpus: every Language Reference topic of this Python, sorted by key."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key].strip() for key in sorted(topics))


def wikitext2_join(rows: list[str]) -> str:
    """The text scored from WikiText-2's test split as the seed card defines it: the `text` rows of
    wikitext-2-raw-v1 test, joined with newlines. This is evalsuite's (and the seed card's) reconstruction,
    not llama.cpp's protocol (its perplexity tool scores the bytes of wiki.test.raw) nor lm-eval's (its
    `wikitext` task scores whole documents of EleutherAI/wikitext_document_level, detokenized)."""
    return "\n".join(rows)


def wikitext2_test_text(*, allow_download: bool = False) -> str:
    """WikiText-2 raw test split from the `datasets` cache (or the hub), joined by `wikitext2_join`.

    Without `allow_download` only the local `datasets` cache is consulted, so a machine without network
    fails at once instead of retrying the hub for half a minute.
    """
    try:
        import datasets
    except ImportError as exc:  # pragma: no cover - datasets is a hard dependency
        raise DependencyError("the `datasets` package is needed for WikiText-2") from exc
    try:
        with hub_offline(not allow_download):
            rows = datasets.load_dataset("Salesforce/wikitext", WIKITEXT2, split="test")
    except Exception as exc:
        hint = (
            ""
            if allow_download
            else " (not in the local cache; pass --corpus-path, --allow-download or --text-file)"
        )
        raise DependencyError(f"WikiText-2 is not available{hint}: {type(exc).__name__}") from exc
    return wikitext2_join(rows["text"])


def _rows_of_raw_file(path: Path) -> list[str]:
    """The rows `datasets` makes of wiki.test.raw: one per line, its newline kept, a blank line empty."""
    rows = []
    with path.open(encoding="utf-8") as fh:
        for line in fh:
            rows.append(line if line.strip() else "")
    return rows


def _rows_of_table(path: Path) -> list[str]:
    """The `text` column of a parquet file or of a `save_to_disk` folder (a Dataset, or a DatasetDict with
    a `test` split)."""
    if path.is_dir():
        import datasets

        try:
            data = datasets.load_from_disk(str(path))
        except FileNotFoundError as exc:
            raise InputError(f"not a datasets save_to_disk folder ({exc})", path) from None
        if isinstance(data, datasets.DatasetDict):
            if "test" not in data:
                raise InputError(f"holds the splits {', '.join(data)}, not `test`", path)
            data = data["test"]
        columns = list(data.column_names)
        column = data["text"] if "text" in columns else None
    else:
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(path)
        except Exception as exc:  # pyarrow raises its own ArrowInvalid / OSError kinds
            raise InputError(f"not a parquet file ({type(exc).__name__}: {exc})", path) from None
        columns = table.column_names
        column = table.column("text").to_pylist() if "text" in columns else None
    if column is None:
        raise InputError(
            f"not the WikiText-2 raw test split: no `text` column (columns: {', '.join(columns)})", path
        )
    if not all(isinstance(row, str) for row in column):
        raise InputError("not the WikiText-2 raw test split: the `text` column holds non-strings", path)
    return list(column)


def wikitext2_from_path(path: Path) -> str:
    """WikiText-2's raw test split from a local copy: a parquet file, a `save_to_disk` folder or
    wiki.test.raw; checked to be that split (a `text` column of 4,358 rows, the first article ` = Robert
    Boulter = `) and joined by `wikitext2_join`. Anything else is refused, naming the file and what
    differs."""
    path = Path(path)
    if not path.exists():
        raise InputError("--corpus-path does not exist", path)
    rows = _rows_of_raw_file(path) if path.is_file() and path.suffix == ".raw" else _rows_of_table(path)
    if len(rows) != WIKITEXT2_TEST_ROWS:
        raise InputError(
            f"not the WikiText-2 raw test split: {len(rows):,} rows, the split has {WIKITEXT2_TEST_ROWS:,}",
            path,
        )
    first = next((row.rstrip("\n") for row in rows if row.strip()), "")
    if first != WIKITEXT2_FIRST_ARTICLE:
        raise InputError(
            f"not the WikiText-2 raw test split: its first article is {first[:60]!r}, the split's is "
            f"{WIKITEXT2_FIRST_ARTICLE!r}",
            path,
        )
    return wikitext2_join(rows)


def load_corpus(
    name: str = "auto",
    *,
    text_file: Path | None = None,
    allow_download: bool = False,
    corpus_path: Path | None = None,
) -> Corpus:
    """Resolve the text to score.

    `text_file` wins over `name`. `corpus_path` is a local copy of WikiText-2's test split (`auto` or
    `wikitext-2-raw-v1`). `auto` takes WikiText-2 when it is cached (or may be downloaded) and the offline
    corpus otherwise, saying why; an explicit `wikitext-2-raw-v1` that cannot be had is an error.
    """
    if corpus_path is not None:
        if text_file is not None or name == PYTHON_DOCS:
            other = "--text-file" if text_file is not None else f"--corpus {name}"
            raise InputError(f"--corpus-path is a copy of WikiText-2; it cannot be combined with {other}")
        path = Path(corpus_path)
        return Corpus(name=WIKITEXT2, text=wikitext2_from_path(path), source=f"local copy {path}")
    if text_file is not None:
        path = Path(text_file)
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise InputError("text file does not exist", path) from None
        except UnicodeDecodeError as exc:
            raise InputError(f"text file is not UTF-8 ({exc.reason} at byte {exc.start})", path) from None
        if not text.strip():
            raise InputError("text file is empty", path)
        return Corpus(name=f"file:{path.name}", text=text)
    if name not in CORPORA:
        raise InputError(f"unknown corpus {name!r}; choose one of {', '.join(CORPORA)}")
    if name == PYTHON_DOCS:
        return Corpus(name=PYTHON_DOCS, text=python_docs_text())
    try:
        text = wikitext2_test_text(allow_download=allow_download)
    except DependencyError as exc:
        if name == WIKITEXT2:
            raise
        return Corpus(name=PYTHON_DOCS, text=python_docs_text(), fallback=f"auto: {exc}")
    return Corpus(name=WIKITEXT2, text=text, source="datasets: Salesforce/wikitext")
