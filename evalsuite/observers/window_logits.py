"""The observation behind `ppl` and `intref`: next-token logits at fixed positions of fixed token windows.

`WindowProtocol` is the declarative protocol (window length, starts, scored positions); `prepare_windows`
tokenizes the text once and cuts the windows both sides get; `WindowLogits` observes one side (the raw
logits of the scored positions on disk, one file per window, and per scored token the true token's NLL and
the top token) and records the compact form a recording keeps. The KL divergence between two observations,
full-vocabulary or against a recording, is computed here from the files, a few rows at a time.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from pydantic import model_validator

from evalsuite.backends.c_heap import release_freed_memory
from evalsuite.backends.layer_pass import LayerVisitor, QuietVisitor
from evalsuite.contract.observation import Observation
from evalsuite.contract.spec import StrictModel
from evalsuite.errors import InputError
from evalsuite.files.digest import DigestCache
from evalsuite.files.run_cache import RunCache
from evalsuite.observers.logits_file import LogitsWriter, core_left_for_writing, read_rows, window_file
from evalsuite.protocol.task import Inputs, Progress, SharedWork
from evalsuite.stats import logit_rows, metrics

if TYPE_CHECKING:
    from evalsuite.backends import Backend
    from evalsuite.backends.streamed import StreamedBackend, WindowCall
    from evalsuite.inputs.corpus import Corpus
    from evalsuite.protocol.side import Side

OBSERVER_NAME = "window-logits"
# The estimator of a KLD computed over every vocabulary entry of two live observations.
FULL_VOCABULARY = "full-vocabulary"


class Starts(StrictModel):
    first: int = 0
    step: int = 4096
    count: int = 8


class Scored(StrictModel):
    first: int = 256
    last: int = 510


class WindowProtocol(StrictModel):
    """Non-overlapping windows of `window` tokens at `starts`; the logits at positions `scored` of each
    window predict the next token."""

    window: int = 512
    starts: Starts = Starts()
    scored: Scored = Scored()
    add_special_tokens: bool = False

    @model_validator(mode="before")
    @classmethod
    def _second_half_scored(cls, data: Any) -> Any:
        """Without `scored`, the second half of each window (llama.cpp's perplexity protocol): every scored
        token has at least half a window of context. For 512 tokens that is the default `Scored`."""
        if isinstance(data, dict) and "scored" not in data and isinstance(data.get("window", 512), int):
            window = data.get("window", 512)
            data = {**data, "scored": {"first": window // 2, "last": window - 2}}
        return data

    def model_post_init(self, _: Any) -> None:
        if not 0 <= self.scored.first <= self.scored.last <= self.window - 2:
            raise ValueError(
                f"scored positions {self.scored.first}..{self.scored.last} must lie in 0..{self.window - 2}"
            )
        if self.starts.count < 1 or self.starts.step < self.window or self.starts.first < 0:
            raise ValueError("windows must not overlap: starts.step >= window, count >= 1, first >= 0")

    @property
    def positions(self) -> torch.Tensor:
        """The scored positions of a window."""
        return torch.arange(self.scored.first, self.scored.last + 1)

    def window_starts(self, n_tokens: int) -> list[int]:
        """Start of every window that fits entirely in `n_tokens` tokens."""
        starts = [self.starts.first + i * self.starts.step for i in range(self.starts.count)]
        return [start for start in starts if start + self.window <= n_tokens]


class RecordOptions(StrictModel):
    """What a recording keeps per scored token: the top-k, and ids drawn (seeded) beyond it."""

    top_k: int = 64
    tail_samples: int = 64
    seed: int = 0


def tokens_sha256(tokens: np.ndarray) -> str:
    """Hash of the token ids fed to both sides (int64 little-endian)."""
    return hashlib.sha256(np.ascontiguousarray(tokens, dtype="<i8").tobytes()).hexdigest()


def _tokenize(side: Side, corpus: Corpus, protocol: WindowProtocol, shared: SharedWork | None) -> np.ndarray:
    """The corpus's ids by a side's tokenizer, shared through `shared` by (folder, tokenizer files and code,
    text, special tokens): `compare` plans every candidate against one reference, and each plan would
    otherwise load its tokenizer and tokenize the text again."""
    checkpoint = side.checkpoint
    disk_key = _token_cache_key(side, corpus, protocol)

    def tokenize() -> np.ndarray:
        cache = RunCache("tokens", enabled=disk_key is not None)  # disabled: reads and keeps nothing
        tokens = cache.tokens(disk_key or {})
        if tokens is None:
            ids = side.tokenizer(corpus.text, add_special_tokens=protocol.add_special_tokens, verbose=False)[
                "input_ids"
            ]
            tokens = np.asarray(ids, dtype=np.int64)
            cache.put_tokens(disk_key or {}, tokens)
        tokens.setflags(write=False)  # shared by every plan that asks: nobody may edit it
        return tokens

    if shared is None:
        return tokenize()
    key = (
        "tokens",
        str(checkpoint.path),
        checkpoint.tokenizer_sha256,
        side.options.trust_remote_code,
        corpus.sha256,
        protocol.add_special_tokens,
    )
    return shared.get(key, tokenize)


def _token_cache_key(side: Side, corpus: Corpus, protocol: WindowProtocol) -> dict[str, str] | None:
    """What a side's ids of the corpus depend on, for the disk cache (`RunCache`): its tokenizer files and
    config (AutoTokenizer may pick the class from config.json), the text and the special-tokens flag. None
    where the files do not decide the ids: code from the checkpoint (`trust_remote_code`), a folder without
    tokenizer files. A tokenizer read from a GGUF file is keyed by the whole file's digest (the run hashes it
    for its observations' keys anyway, and cached by the file's identity): Transformers rebuilds it from the
    file's vocabulary with the gguf package's reader, seconds for a vocabulary of 50,000 tokens, each run."""
    checkpoint = side.checkpoint
    if side.options.trust_remote_code:
        return None
    gguf = {}
    if checkpoint.gguf_file is not None:
        gguf = {"gguf": DigestCache.default().sha256(checkpoint.gguf_file)}
    elif not checkpoint.tokenizer_files():
        return None
    config = checkpoint.path / "config.json"
    config_sha = hashlib.sha256(config.read_bytes()).hexdigest() if config.is_file() else ""
    return {
        "tokenizer": checkpoint.tokenizer_sha256,
        "config": config_sha,
        **gguf,
        "corpus": corpus.sha256,
        "add_special_tokens": str(protocol.add_special_tokens),
    }


def prepare_windows(
    protocol: WindowProtocol, corpus: Corpus, ref: Side, ckpt: Side, shared: SharedWork | None = None
) -> Inputs:
    """Tokenize once with the reference's tokenizer (the candidate's must give the same ids) and cut the
    windows. A recorded reference has no tokenizer: the candidate's tokens are used, and checked against
    the recording's hash before anything runs. `shared`: the run's, where its ids are kept for the next
    plan (`_tokenize`)."""
    tokens = _tokenize(ckpt if ref.is_recorded else ref, corpus, protocol, shared)
    # Byte-identical tokenizer files give identical ids: the second tokenization would only cost time.
    if not ref.is_recorded and ref.checkpoint.tokenizer_sha256 != ckpt.checkpoint.tokenizer_sha256:
        other = _tokenize(ckpt, corpus, protocol, shared)
        if other.shape != tokens.shape or not np.array_equal(other, tokens):
            where = metrics.first_divergence(tokens, other)
            raise InputError(
                f"its tokenizer disagrees with the reference's on the {corpus.name} text "
                f"(first differing token at index {where}); the sides cannot be compared",
                ckpt.checkpoint.path,
            )
    starts = protocol.window_starts(len(tokens))
    if not starts:
        raise InputError(
            f"the {corpus.name} text has {len(tokens)} tokens, fewer than one {protocol.window}-token window"
        )
    windows = np.stack([tokens[s : s + protocol.window] for s in starts])
    return {
        "corpus": corpus.name,
        "corpus_sha256": corpus.sha256,
        "n_tokens_text": len(tokens),
        "starts": starts,
        "windows": windows,
        "tokens_sha256": tokens_sha256(windows),
    }


class WindowObserver:
    """Base of the observers that run a side over a `WindowProtocol`'s windows: the protocol is what shapes
    their observation, so it is their identity (a subclass adds whatever else shapes its own)."""

    name: str

    def __init__(self, protocol: WindowProtocol) -> None:
        self.protocol = protocol

    def identity(self) -> dict[str, Any]:
        return {"protocol": self.protocol.model_dump(mode="json")}


def window_tensor(inputs: Inputs) -> torch.Tensor:
    """The prepared windows (`prepare_windows`) as one (windows, tokens) tensor."""
    return torch.from_numpy(np.ascontiguousarray(inputs["windows"]))


def window_logits_meta(backend: Backend, inputs: Inputs) -> dict[str, Any]:
    """What an observation of window logits says of the windows and of the execution that produced it."""
    return {
        "vocab_size": backend.vocab_size,
        "n_windows": len(inputs["windows"]),
        "window_starts": list(inputs["starts"]),
        "tokens_sha256": inputs["tokens_sha256"],
        "corpus": inputs["corpus"],
        "n_tokens_text": inputs["n_tokens_text"],
        "execution": backend.describe(),
    }


def log_softmax64(logits: torch.Tensor) -> torch.Tensor:
    """Log-probabilities in float64 from stored logits."""
    return torch.log_softmax(logits.double(), dim=-1)


class WindowLogits(WindowObserver):
    """Observer: the raw logits of every scored position (one file per window), the true token's NLL and the
    top token per scored position. Resumes at the first window without a completed file."""

    name = OBSERVER_NAME

    def __init__(
        self, protocol: WindowProtocol, record: RecordOptions | None = None, chunk_rows: int = 16
    ) -> None:
        super().__init__(protocol)
        self.record_options = record or RecordOptions()
        self.chunk_rows = chunk_rows

    def observe(self, backend: Backend, inputs: Inputs, folder: Path, progress: Progress) -> Observation:
        from evalsuite.backends.layer_pass import observe_alone
        from evalsuite.backends.streamed import StreamedBackend

        windows = window_tensor(inputs)
        if isinstance(backend, StreamedBackend):
            return observe_alone(self.visitor(backend, inputs, folder), backend, windows, folder, progress)
        step = progress("window logits", len(windows))
        return self.observed(
            backend,
            inputs,
            folder,
            lambda todo: backend.window_logits(windows[todo], self.protocol.positions),
            step,
        )

    def visitor(self, backend: StreamedBackend, inputs: Inputs, folder: Path) -> LayerVisitor:
        """This observation made during a shared streamed pass: the head on the last layer's output."""
        return WindowLogitsVisitor(self, backend, inputs, folder)

    def observed(
        self,
        backend: Backend,
        inputs: Inputs,
        folder: Path,
        logits_of: Callable[[list[int]], Iterable[torch.Tensor]],
        step: Callable[[], None],
    ) -> Observation:
        """The observation from the logits `logits_of(windows)` yields for the windows whose file is not yet
        written (an interrupted observation resumes at the first window without one)."""
        positions = self.protocol.positions
        windows = window_tensor(inputs)
        writer = LogitsWriter(folder)
        todo = [w for w in range(len(windows)) if not writer.done(w)]
        for _ in range(len(windows) - len(todo)):
            step()
        expected = (len(positions), backend.vocab_size)
        # Each window's NLL and top tokens, from its rows while they are in memory (a window a resumed
        # observation found on disk: from its file).
        scores: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        try:
            for w, logits in zip(todo, logits_of(todo), strict=True):
                check_logits_shape(logits, expected)
                rows = logits.cpu()
                # The write runs beside the scores, which take one core; where no core is free for it beside
                # the next forward, it is finished before that forward starts.
                writer.write(w, rows)
                scores[w] = self._window_scores(rows.split(self.chunk_rows), windows[w], positions)
                release_freed_memory()  # the window's temporaries, as `record` hands back each block's
                if not core_left_for_writing(logits):
                    writer.flush()
                step()
        finally:
            writer.close()
        files = {f"window-{w:04d}": window_file(folder, w) for w in range(len(windows))}
        for w, path in enumerate(files.values()):
            if w not in scores:
                scores[w] = self._window_scores(read_rows([path], self.chunk_rows), windows[w], positions)
        nll = np.concatenate([scores[w][0] for w in range(len(windows))])
        top = np.concatenate([scores[w][1] for w in range(len(windows))]).astype(np.int64)
        return Observation(
            name=self.name,
            meta=window_logits_meta(backend, inputs),
            arrays={"nll": nll, "top": top},
            files=files,
        )

    @staticmethod
    def _window_scores(
        blocks: Iterable[torch.Tensor], window: torch.Tensor, positions: torch.Tensor
    ) -> tuple[np.ndarray, np.ndarray]:
        """NLL of the true next token and the top token of every scored position of one window, from its logit
        rows in successive blocks (`logit_rows.row_scores`: float32 exps, float64 sums, the arithmetic a
        candidate compared as it is made gets from its comparison)."""
        targets = window[positions + 1]
        scores, nll, top, offset = RowScores(), [], [], 0
        for block in blocks:
            block_nll, block_top = scores(block, targets[offset : offset + len(block)])
            nll.append(block_nll)
            top.append(block_top)
            offset += len(block)
        return np.concatenate(nll), np.concatenate(top)

    def record(self, obs: Observation, folder: Path) -> Observation:
        """The compact form a later comparison needs (no full logits).

        Per scored token: the true token's NLL, the top-k ids and log-probs, the probability mass outside the
        top-k, and `tail_samples` ids drawn (seeded) from the distribution restricted to that tail, with their
        log-probs: enough for an unbiased KL divergence against any candidate.
        """
        opts = self.record_options
        generator = torch.Generator().manual_seed(opts.seed)
        parts: dict[str, list[torch.Tensor]] = {k: [] for k in COMPACT_ARRAYS}
        for block in read_rows(window_paths(obs), self.chunk_rows):
            for k, v in compact_rows(log_softmax64(block), opts, generator).items():
                parts[k].append(v)
            # A block's vocabulary-wide temporaries (32 MB each at 248 k) are served from the heaps, between
            # the small parts that live on: freed, they are holes the next block's do not fit, and the heaps
            # grew by about a block each time (several GB over the protocol's windows at 248 k). Handed back
            # to the system after each block, they cost a page fault each and no memory.
            release_freed_memory()
        arrays = {k: torch.cat(v).numpy() for k, v in parts.items()}
        arrays.update(nll=obs.arrays["nll"], top=obs.arrays["top"])
        meta = {**obs.meta, "kind": "recorded", "top_k": opts.top_k, "tail_samples": opts.tail_samples}
        return Observation(name=obs.name, key=obs.key, meta=meta, arrays=arrays)


class WindowLogitsVisitor(QuietVisitor):
    """`WindowLogits` during a shared streamed pass: the model's own head on each window's last output."""

    def __init__(
        self, observer: WindowLogits, backend: StreamedBackend, inputs: Inputs, folder: Path
    ) -> None:
        self.observer, self.backend, self.inputs, self.folder = observer, backend, inputs, folder

    def finish(self, final: list[torch.Tensor], calls: list[WindowCall]) -> Observation:
        positions = self.observer.protocol.positions

        def logits_of(todo: list[int]) -> Iterator[torch.Tensor]:
            for w in todo:
                yield self.backend.head_logits(final[w], calls[w], positions)

        return self.observer.observed(self.backend, self.inputs, self.folder, logits_of, lambda: None)


# The arrays of a reference's compact form (`compact_rows`), beside its NLL and top token.
COMPACT_ARRAYS = ("top_ids", "top_logp", "tail_mass", "tail_ids", "tail_logp")


def compact_rows(
    lp: torch.Tensor, opts: RecordOptions, generator: torch.Generator
) -> dict[str, torch.Tensor]:
    """The compact form of rows of float64 log-probabilities (`COMPACT_ARRAYS`): the top-k ids and
    log-probs, the mass beyond them, and `tail_samples` ids drawn from that tail with their log-probs."""
    top_logp, top_ids = lp.topk(min(opts.top_k, lp.shape[-1]), dim=-1)
    tail = lp.scatter(1, top_ids, float("-inf"))
    tail_log_mass = torch.logsumexp(tail, dim=-1)
    if opts.tail_samples and lp.shape[-1] > opts.top_k:
        q = (tail - tail_log_mass[:, None]).exp()
        ids = torch.multinomial(q, opts.tail_samples, replacement=True, generator=generator)
    else:
        ids = torch.empty((len(lp), 0), dtype=torch.long)
    return {
        "top_ids": top_ids.int(),
        "top_logp": top_logp.float(),
        "tail_mass": tail_log_mass.exp(),
        "tail_ids": ids.int(),
        "tail_logp": lp.gather(1, ids).float(),
    }


def window_paths(obs: Observation) -> list[Path]:
    """The observation's per-window logits files, in window order."""
    return [obs.files[name] for name in sorted(obs.files) if name.startswith("window-")]


def same_inputs(observations: dict[str, Observation]) -> None:
    """Refuse observations made on different tokens or vocabularies (InputError naming what differs)."""
    for key in ("tokens_sha256", "vocab_size"):
        values = {label: obs.meta.get(key) for label, obs in observations.items()}
        if len(set(map(str, values.values()))) > 1:
            shown = ", ".join(f"{label} {value}" for label, value in values.items())
            raise InputError(f"the observations were made on different inputs ({key}: {shown})")


def check_logits_shape(logits: torch.Tensor, expected: tuple[int, int]) -> None:
    """Refuse a window's logits that are not (scored positions, vocabulary) (InputError)."""
    if tuple(logits.shape) != expected:
        raise InputError(f"the model returned logits of shape {tuple(logits.shape)}, expected {expected}")


class RowScores:
    """The NLL of the true next token and the top token of successive blocks of one side's logit rows
    (`logit_rows.row_scores`), in buffers kept from block to block."""

    def __init__(self) -> None:
        self.scratch: logit_rows.RowScratch | None = None

    def __call__(self, block: torch.Tensor, targets: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        n, vocab = block.shape
        if self.scratch is None or self.scratch.rows < n or self.scratch.vocab != vocab:
            self.scratch = logit_rows.RowScratch(n, vocab)  # np.empty: the two buffers unused cost nothing
        return logit_rows.row_scores(numpy_rows(block.cpu()), targets.cpu().numpy(), self.scratch)


def numpy_rows(block: torch.Tensor) -> np.ndarray:
    """A block of logits as numpy holds them (bf16 as its 16 bits: numpy has no bfloat16)."""
    return (block.view(torch.uint16) if block.dtype == torch.bfloat16 else block).numpy()


def check_same_shape(x: torch.Tensor, y: torch.Tensor) -> None:
    """Refuse two sides' blocks of logit rows that differ in shape (InputError)."""
    if x.shape != y.shape:
        raise InputError(
            f"the sides' logits differ in shape: {tuple(x.shape)} vs {tuple(y.shape)} "
            "(different vocabularies?)"
        )


def kld_per_token(ref: Observation, ckpt: Observation, chunk_rows: int) -> tuple[np.ndarray, str]:
    """KL(P_ref ‖ P_ckpt) of every scored token, and the estimator used: full-vocabulary from two live
    observations, or exact over the recorded top-k with an unbiased estimate beyond it."""
    if ref.meta.get("kind") == "recorded":
        return _kld_against_recording(ref, ckpt, chunk_rows), (
            f"top-{ref.meta['top_k']} exact + {ref.meta['tail_samples']} sampled tail ids (recording)"
        )
    out = []
    pairs = zip(
        read_rows(window_paths(ref), chunk_rows), read_rows(window_paths(ckpt), chunk_rows), strict=True
    )
    for x, y in pairs:
        check_same_shape(x, y)
        out.append(metrics.kl_divergence(log_softmax64(x).numpy(), log_softmax64(y).numpy()))
    return np.concatenate(out), FULL_VOCABULARY


def _kld_against_recording(ref: Observation, ckpt: Observation, chunk_rows: int) -> np.ndarray:
    a = ref.arrays
    out, start = [], 0
    for block in read_rows(window_paths(ckpt), chunk_rows):
        rows = slice(start, start + len(block))
        start += len(block)
        lp = log_softmax64(block)
        top_ids = torch.from_numpy(a["top_ids"][rows]).long()
        tail_ids = torch.from_numpy(a["tail_ids"][rows]).long()
        out.append(
            metrics.kl_divergence_top_k_tail(
                a["top_logp"][rows],
                lp.gather(1, top_ids).numpy(),
                a["tail_mass"][rows],
                a["tail_logp"][rows],
                lp.gather(1, tail_ids).numpy(),
            )
        )
    return np.concatenate(out)


def ppl_summary(
    name: str, nll: np.ndarray, n_windows: int = 0, labels: np.ndarray | None = None
) -> dict[str, float]:
    """`ppl_NAME` with its per-token and window-clustered standard errors (PPL × the error of ln PPL): the
    tokens laid out `n_windows` equal windows after one another, or clustered by `labels` (a chat each)."""
    ppl = metrics.perplexity(nll)
    if labels is None:
        labels = metrics.window_labels(n_windows, len(nll) // n_windows)
    return {
        f"ppl_{name}": ppl,
        f"ppl_{name}_stderr": ppl * metrics.ln_perplexity(nll).stderr,
        f"ppl_{name}_stderr_window": ppl * metrics.clustered_stderr(nll, labels),
    }
