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
which are hashed once per length asked. A calibration chat is one text, its turns' contents joined by
newlines, as a smoke prompt's turns are: a prompt that is a chat's turn, or several of its turns, lies inside
it token for token (a byte-level BPE tokenizer starts a word after a newline as at a text's start). A prompt
quoted inside a running sentence may tokenise differently at its first token (a leading space joined to the
word) and is then found by its 13-grams only.

The hash of a 13-gram is a polynomial in its token ids modulo 2^64 with a fixed odd multiplier, mixed by
SplitMix64's finaliser: a collision of two different 13-grams has a chance of about 2^-64 each, negligible
against the millions of 13-grams of a calibration set.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from evalsuite.chats import read_chats
from evalsuite.errors import InputError

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
    """A calibration set's texts as token ids under one tokenizer, with what it was read from: its `n`-gram
    hashes (sorted, unique, none crossing from one text into the next) found once, those of a shorter length
    k when a unit of k tokens is first looked for."""

    source: str
    sha256: str
    ids: np.ndarray  # every text's token ids, one text after the other
    ends: np.ndarray  # where each text's ids end in `ids`
    n: int = NGRAM
    _grams: dict[int, np.ndarray] = field(default_factory=dict, init=False, repr=False, compare=False)

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
        found = cls(source, sha256, ids, np.cumsum(lengths), n)
        found.grams(n)
        return found

    @property
    def n_texts(self) -> int:
        return len(self.ends)

    @property
    def n_tokens(self) -> int:
        return len(self.ids)

    @property
    def hashes(self) -> np.ndarray:
        """The set's `n`-gram hashes, sorted and unique."""
        return self.grams(self.n)

    def grams(self, k: int) -> np.ndarray:
        """The hashes of every run of `k` consecutive tokens inside one text, sorted and unique (cached per k:
        a race of two threads computes the same array twice, harmlessly)."""
        if k not in self._grams:
            hashes = ngram_hashes(self.ids, k)
            # A run starting at i lies inside one text when that text ends at or after i + k.
            end_of_text = np.repeat(self.ends, np.diff(self.ends, prepend=0))[: len(hashes)]
            inside = np.arange(len(hashes)) + k <= end_of_text
            self._grams[k] = _sorted_unique(hashes[inside])
        return self._grams[k]

    def overlapping(self, ids: np.ndarray) -> np.ndarray:
        """Which tokens of `ids` lie in some `n`-gram that the set holds (bool, one per token); all of a
        sequence shorter than `n` where it occurs whole inside one text, else none."""
        ids = np.asarray(ids)
        if 0 < len(ids) < self.n:
            whole = ngram_hashes(ids, len(ids))
            return np.full(len(ids), bool(_members(whole, self.grams(len(ids))).any()))
        found = _members(ngram_hashes(ids, self.n), self.hashes)
        mask = np.zeros(len(ids), dtype=bool)
        for j in range(self.n if len(found) else 0):
            mask[j : j + len(found)] |= found
        return mask

    def shares(self, sequences: Sequence[np.ndarray]) -> np.ndarray:
        """The share of each sequence's tokens that overlap the set."""
        return np.array([self.overlapping(s).mean() if len(s) else 0.0 for s in sequences], dtype=np.float64)


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
    """The texts of a calibration file: a JSONL file of chats (`{"messages": [...]}`, each chat one text: its
    messages' contents joined by newlines, as a smoke prompt's are) or of documents (`{"text": ...}`), else
    the whole file as one text."""
    path = Path(path)
    try:
        raw = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InputError("calibration file does not exist", path) from None
    except IsADirectoryError:
        raise InputError("calibration data is a folder; give one text or JSONL file", path) from None
    except UnicodeDecodeError as exc:
        raise InputError(f"calibration file is not UTF-8 ({exc.reason} at byte {exc.start})", path) from None
    first = next((line for line in raw.splitlines() if line.strip()), "")
    if path.suffix in (".jsonl", ".json") or _json_object(first):
        if '"messages"' in first:
            # Joined, a chat's n-grams run across its turns: a multi-turn prompt whose every turn is shorter
            # than n tokens is found in the chat that holds it.
            chats = read_chats(path, "calibration file")
            return ["\n".join(content for _, content in chat.messages) for chat in chats]
        return _documents(raw, path)
    if not raw.strip():
        raise InputError("calibration file is empty", path)
    return [raw]


def _json_object(line: str) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except json.JSONDecodeError:
        return False


def _documents(raw: str, path: Path) -> list[str]:
    texts = []
    for number, line in enumerate(raw.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            doc = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InputError(f"line {number}: not JSON ({exc.msg})", path) from None
        text = doc.get("text") if isinstance(doc, dict) else None
        if not isinstance(text, str):
            raise InputError(f'line {number}: neither {{"messages": [...]}} nor {{"text": "..."}}', path)
        texts.append(text)
    if not texts:
        raise InputError("calibration file holds no text", path)
    return texts


def calibration_set(path: Path, tokenizer: Any, n: int = NGRAM) -> CalibrationSet:
    """A calibration file's texts under `tokenizer`, each tokenised alone (`token_ids`), and its `n`-gram
    hashes."""
    texts = [token_ids(tokenizer, text) for text in calibration_texts(path)]
    digest = hashlib.sha256(Path(path).read_bytes()).hexdigest()
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
