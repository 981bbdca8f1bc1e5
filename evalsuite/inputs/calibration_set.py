"""The calibration set kept apart from the evaluation: which evaluated tokens a pack's calibration data holds.

A pack calibrated on the text it is then scored on can score better than its own source (exllamav3#108): its
rounding was fitted to those very tokens. So every text evalsuite scores is checked against the calibration
set given (`--calibration FILE`, or the data set a pack's metadata names where it is a file on disk): both are
tokenised by the reference's tokenizer, every run of 13 consecutive tokens (a 13-gram, the length
contamination studies of GPT-3 and its successors use) is hashed, and an evaluated token overlaps the set
where some 13-gram it belongs to is one of the set's. A window, chat, prompt or question whose share of
overlapping tokens exceeds the spec's bound is flagged; the task reports its verdict with and without the
flagged ones.

A unit shorter than 13 tokens (a short smoke prompt, a vision question) holds no 13-gram, yet the
contamination that matters for it is a calibration chat whose user turn is that very prompt. So a unit shorter
than n tokens overlaps where its whole token sequence occurs contiguously inside one calibration text (its
share is then 1.0, else 0.0): its k tokens are hashed as one k-gram and looked for among the set's k-grams,
hashed a block at a time in one pass per length asked and never kept (a table of them per length would take
8 bytes a token of the set, each). A calibration chat is one text, its turns' contents joined by newlines, as
a smoke prompt's turns are: a prompt that is a chat's turn, or several of its turns, lies inside
it token for token (a byte-level BPE tokenizer starts a word after a newline as at a text's start). A prompt
quoted inside a running sentence may tokenise differently at its first token (a leading space joined to the
word) and is then found by its 13-grams only. A calibration file is JSONL, a JSON array, a parquet or an Arrow
file of documents (`{"text": …}`) and chats (`{"messages": […]}`: a prompt alone, a `tool` turn read as they
are), or one plain text.

The hash of a 13-gram is a polynomial in its token ids modulo 2^64 with a fixed odd multiplier, mixed by
SplitMix64's finaliser: a collision of two different 13-grams has a chance of about 2^-64 each, negligible
against the millions of 13-grams of a calibration set.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from evalsuite.errors import InputError
from evalsuite.inputs.chat_files import json_lines, parse_chat, read_text

NGRAM = 13
_MULTIPLIER = np.uint64(0x9E3779B97F4A7C15)
# The keys under which a pack's metadata (config.json's quantization_config, recipe.yaml) names the data it
# was calibrated on: AutoRound's `dataset`, llm-compressor's and others' spellings.
DATASET_KEYS = ("dataset", "calibration_dataset", "calib_dataset", "dataset_path", "calibration_data")


def ngram_hashes(ids: np.ndarray, n: int = NGRAM) -> np.ndarray:
    """The hash of every run of `n` consecutive token ids, in order (len(ids) − n + 1 of them; none for a
    shorter sequence), as uint64."""
    ids = np.asarray(ids, dtype=np.int64)
    if len(ids) < n:
        return np.empty(0, dtype=np.uint64)
    values = ids.astype(np.uint64) + np.uint64(1)
    count = len(ids) - n + 1
    h = np.zeros(count, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for j in range(n):
            h = h * _MULTIPLIER + values[j : j + count]
        # SplitMix64's finaliser: every input bit reaches every output bit.
        h ^= h >> np.uint64(30)
        h *= np.uint64(0xBF58476D1CE4E5B9)
        h ^= h >> np.uint64(27)
        h *= np.uint64(0x94D049BB133111EB)
        h ^= h >> np.uint64(31)
    return h


@dataclass(frozen=True)
class CalibrationSet:
    """A calibration set's texts as token ids under one tokenizer, with what it was read from and its
    `n`-gram hashes (sorted, unique, none crossing from one text into the next). A unit shorter than n tokens
    is looked for whole with one pass over the set's runs of its length, a block of them at a time: no table
    of the set's shorter runs is kept, so memory grows with the block and the units, not with the set."""

    source: str
    sha256: str
    ids: np.ndarray  # every text's token ids, one text after the other
    ends: np.ndarray  # where each text's ids end in `ids`
    n: int = NGRAM
    hashes: np.ndarray = field(default_factory=lambda: np.empty(0, np.uint64), repr=False, compare=False)

    @classmethod
    def of_texts(
        cls, texts: Sequence[np.ndarray], source: str, sha256: str, n: int = NGRAM
    ) -> CalibrationSet:
        """The set of texts given as token ids."""
        lengths = np.array([len(t) for t in texts], dtype=np.int64)
        # int32 holds any vocabulary's ids at half the memory: a calibration set can be millions of tokens.
        ids = (
            np.concatenate([np.asarray(t, dtype=np.int32) for t in texts]) if texts else np.empty(0, np.int32)
        )
        ends = np.cumsum(lengths)
        blocks = list(_runs_inside(ids, ends, n))
        hashes = _sorted_unique(np.concatenate(blocks)) if blocks else np.empty(0, np.uint64)
        return cls(source, sha256, ids, ends, n, hashes)

    @property
    def n_texts(self) -> int:
        return len(self.ends)

    @property
    def n_tokens(self) -> int:
        return len(self.ids)

    def overlapping(self, ids: np.ndarray) -> np.ndarray:
        """Which tokens of `ids` lie in some `n`-gram that the set holds (bool, one per token); all of a
        sequence shorter than `n` where it occurs whole inside one text, else none."""
        ids = np.asarray(ids)
        if 0 < len(ids) < self.n:
            return np.full(len(ids), bool(self.holds_whole([ids])[0]))
        found = _members(ngram_hashes(ids, self.n), self.hashes)
        mask = np.zeros(len(ids), dtype=bool)
        for j in range(self.n if len(found) else 0):
            mask[j : j + len(found)] |= found
        return mask

    def holds_whole(self, units: Sequence[np.ndarray]) -> np.ndarray:
        """Whether each of `units` (each shorter than `n`) occurs whole inside one text of the set: per
        length, the units' hashes looked for among the set's runs of that length, a block at a time."""
        lengths = np.array([len(u) for u in units], dtype=np.int64)
        held = np.zeros(len(units), dtype=bool)
        for k in np.unique(lengths[lengths > 0]).tolist():
            which = np.flatnonzero(lengths == k)
            wanted = np.array([ngram_hashes(units[i], k)[0] for i in which], dtype=np.uint64)
            table = _sorted_unique(wanted)
            seen = np.zeros(len(table), dtype=bool)
            for block in _runs_inside(self.ids, self.ends, k):
                at = np.minimum(np.searchsorted(table, block), len(table) - 1)
                seen[at[table[at] == block]] = True
            held[which] = seen[np.searchsorted(table, wanted)]
        return held

    def shares(self, sequences: Sequence[np.ndarray]) -> np.ndarray:
        """The share of each sequence's tokens that overlap the set (the units shorter than `n` looked for
        together: `holds_whole`)."""
        out = np.zeros(len(sequences), dtype=np.float64)
        short = [i for i, s in enumerate(sequences) if 0 < len(s) < self.n]
        out[short] = self.holds_whole([np.asarray(sequences[i]) for i in short])
        for i, sequence in enumerate(sequences):
            if len(sequence) >= self.n:
                out[i] = self.overlapping(sequence).mean()
        return out


# Runs of tokens hashed at a time: a few MB of temporaries, however large the set.
_BLOCK = 1 << 16


def _runs_inside(ids: np.ndarray, ends: np.ndarray, k: int) -> Iterator[np.ndarray]:
    """The hashes of the runs of `k` consecutive tokens of `ids` that lie inside one text (`ends`: where each
    text ends), in order, `_BLOCK` runs at a time."""
    count = len(ids) - k + 1
    for first in range(0, max(count, 0), _BLOCK):
        stop = min(first + _BLOCK, count)
        hashes = ngram_hashes(ids[first : stop + k - 1], k)
        starts = np.arange(first, stop)
        # A run starting at i lies inside one text when the text i is in ends at or after i + k.
        yield hashes[starts + k <= ends[np.searchsorted(ends, starts, side="right")]]


# numpy 2's np.unique and np.isin on uint64 take seconds on a set of millions of hashes (per call, for isin);
# a sort and a binary search take milliseconds.
def _sorted_unique(values: np.ndarray) -> np.ndarray:
    ordered = np.sort(values)
    return ordered[np.concatenate(([True], ordered[1:] != ordered[:-1]))] if len(ordered) else ordered


def _members(values: np.ndarray, table: np.ndarray) -> np.ndarray:
    """Which of `values` are in `table` (sorted, unique)."""
    if not len(table):
        return np.zeros(len(values), dtype=bool)
    at = np.minimum(np.searchsorted(table, values), len(table) - 1)
    return table[at] == values


def token_ids(tokenizer: Any, text: str) -> np.ndarray:
    """A text's token ids by itself: no special tokens, no chat template (how a calibration text is tokenised,
    and every evaluated text that is compared with it)."""
    return np.asarray(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"], dtype=np.int64)


def calibration_texts(path: Path) -> list[str]:
    """The texts of a calibration file: its documents (`{"text": ...}`) and chats (`{"messages": [...]}`, each
    one text: `Chat.text`, its messages' contents joined by newlines, as a smoke prompt's are; a prompt alone,
    a tool's turn and a tool call's empty content read as they are) from a JSONL file, a JSON array, a parquet
    file or an Arrow file (`datasets`' own, or Arrow IPC); any other file is one text."""
    path = Path(path)
    if path.suffix in TABLE_SUFFIXES:
        docs = _table_rows(path)
    else:
        raw = read_text(path, "calibration file")
        first = next((line for line in raw.splitlines() if line.strip()), "")
        whole = _json_array(raw) if raw.lstrip().startswith("[") else None
        if whole is not None:
            docs = [(f"item {i}", doc) for i, doc in enumerate(whole)]
        elif path.suffix in (".jsonl", ".json") or _json_object(first):
            docs = json_lines(raw, path)
        elif raw.strip():
            return [raw]
        else:
            raise InputError("calibration file is empty", path)
    texts = [_text(doc, where, path) for where, doc in docs]
    if not texts:
        raise InputError("calibration file holds no text", path)
    return texts


# The calibration files read as tables, by `pyarrow`: parquet, and Arrow (`datasets`' cache files, IPC).
TABLE_SUFFIXES = (".parquet", ".arrow")


def _table_rows(path: Path) -> list[tuple[str, Any]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    kind = "a parquet" if path.suffix == ".parquet" else "an Arrow"
    if not path.is_file():
        raise InputError("calibration file does not exist", path)
    try:
        if path.suffix == ".parquet":
            table = pq.read_table(path)
        else:
            with pa.memory_map(str(path)) as source:
                # `datasets` writes Arrow's streaming format; others its file format.
                try:
                    table = pa.ipc.open_stream(source).read_all()
                except pa.ArrowInvalid:
                    table = pa.ipc.open_file(source).read_all()
    except (pa.ArrowException, OSError) as exc:  # pyarrow raises its own ArrowInvalid / OSError kinds
        raise InputError(f"not {kind} file ({type(exc).__name__}: {exc})", path) from None
    return [(f"row {i}", row) for i, row in enumerate(table.to_pylist())]


def _json_array(raw: str) -> list[Any] | None:
    """The file as one JSON array; None where it is not one (JSON Lines whose first line is an array)."""
    try:
        doc = json.loads(raw)
    except json.JSONDecodeError:
        return None
    return doc if isinstance(doc, list) else None


def _json_object(line: str) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except json.JSONDecodeError:
        return False


def _text(doc: Any, where: str, path: Path) -> str:
    """The text of one document or chat of a calibration file (`where` it is, for errors)."""
    if isinstance(doc, dict) and "messages" in doc:
        # Joined, a chat's n-grams run across its turns: a multi-turn prompt whose every turn is shorter than
        # n tokens is found in the chat that holds it.
        return parse_chat(doc, where, path, scored=False).text
    text = doc.get("text") if isinstance(doc, dict) else None
    if not isinstance(text, str):
        raise InputError(f'{where}: neither {{"messages": [...]}} nor {{"text": "..."}}', path)
    return text


def calibration_set(path: Path, tokenizer: Any, n: int = NGRAM) -> CalibrationSet:
    """A calibration file's texts under `tokenizer`, each tokenised alone (`token_ids`), and its `n`-gram
    hashes."""
    texts = [token_ids(tokenizer, text) for text in calibration_texts(path)]
    with open(path, "rb") as file:
        digest = hashlib.file_digest(file, "sha256").hexdigest()
    return CalibrationSet.of_texts(texts, str(path), digest, n)


def named_calibration_data(folder: Path) -> tuple[Path | None, str | None]:
    """The calibration data a pack's metadata names (config.json's `quantization_config`, recipe.yaml): its
    path where it is a file on disk (absolute, or relative to the pack's folder), else None with what was
    named and why it is not read; (None, None) where nothing is named."""
    named = _named_dataset(folder)
    if named is None:
        return None, None
    for candidate in (Path(named), folder / named):
        if candidate.is_file():
            return candidate, None
    return None, f"{named} (named by the pack's metadata; not a file on disk, so not checked)"


def _named_dataset(folder: Path) -> str | None:
    docs: list[Any] = []
    config = folder / "config.json"
    if config.is_file():
        # A config that is not JSON is the checkpoint's business, refused where it is read.
        with contextlib.suppress(json.JSONDecodeError, UnicodeDecodeError, AttributeError):
            docs.append((json.loads(config.read_text(encoding="utf-8")) or {}).get("quantization_config"))
    recipe = folder / "recipe.yaml"
    if recipe.is_file():
        import yaml

        with contextlib.suppress(yaml.YAMLError, UnicodeDecodeError):
            docs.append(yaml.safe_load(recipe.read_text(encoding="utf-8")))
    for doc in docs:
        found = _find_key(doc)
        if found is not None:
            return found
    return None


def _find_key(doc: Any) -> str | None:
    """The first string value under one of `DATASET_KEYS`, searching nested tables and lists."""
    if isinstance(doc, dict):
        for key in DATASET_KEYS:
            if isinstance(doc.get(key), str) and doc[key].strip():
                return doc[key].strip()
        values: list[Any] = list(doc.values())
    elif isinstance(doc, list):
        values = doc
    else:
        return None
    for value in values:
        found = _find_key(value)
        if found is not None:
            return found
    return None
