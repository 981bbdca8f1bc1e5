"""The text the `ppl` protocol scores: WikiText-2 through `datasets`, a user's file, or an offline corpus.

No data set can be fetched on CI or on air-gapped machines, so evalsuite also assembles an English corpus from
text that every CPython install carries: the Python Language Reference topics in `pydoc_data.topics`. It is
deterministic for a given Python version, and the report names the corpus and hashes its tokens, so two runs
on different corpora can never be compared by accident.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from evalsuite.errors import DependencyError, InputError

WIKITEXT2 = "wikitext-2-raw-v1"
PYTHON_DOCS = "python-docs"
CORPORA = ("auto", WIKITEXT2, PYTHON_DOCS)


@dataclass(frozen=True)
class Corpus:
    """A named text: `name` says where it came from, `sha256` hashes its UTF-8 bytes."""

    name: str
    text: str

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode("utf-8")).hexdigest()


def python_docs_text() -> str:
    """The offline English corpus: every Language Reference topic of this Python, sorted by key."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key].strip() for key in sorted(topics))


def wikitext2_test_text(*, allow_download: bool = False) -> str:
    """WikiText-2 raw test split, rows joined with newlines (the protocol of llama.cpp and lm-eval).

    Without `allow_download` only the local `datasets` cache is consulted, so a machine without network
    fails at once instead of retrying the hub for half a minute.
    """
    if not allow_download:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    try:
        import datasets
    except ImportError as exc:  # pragma: no cover - datasets is a hard dependency
        raise DependencyError("the `datasets` package is needed for WikiText-2") from exc
    try:
        rows = datasets.load_dataset("Salesforce/wikitext", WIKITEXT2, split="test")
    except Exception as exc:
        hint = "" if allow_download else " (not in the local cache; pass --allow-download or --text-file)"
        raise DependencyError(f"WikiText-2 is not available{hint}: {type(exc).__name__}") from exc
    return "\n".join(rows["text"])


def load_corpus(name: str = "auto", *, text_file: Path | None = None, allow_download: bool = False) -> Corpus:
    """Resolve the text to score.

    `text_file` wins over `name`. `auto` takes WikiText-2 when it is cached (or may be downloaded) and the
    offline corpus otherwise; an explicit `wikitext-2-raw-v1` that cannot be had is an error.
    """
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
        return Corpus(name=WIKITEXT2, text=wikitext2_test_text(allow_download=allow_download))
    except DependencyError:
        if name == WIKITEXT2:
            raise
        return Corpus(name=PYTHON_DOCS, text=python_docs_text())
