"""Perplexity and next-token agreement on fixed windows of a text (the WikiText-2 protocol)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, BinaryIO, ClassVar

import numpy as np
import torch

from evalsuite import metrics, plots
from evalsuite.corpus import Corpus
from evalsuite.errors import InputError
from evalsuite.recording import tokenizer_sha256
from evalsuite.side import Side
from evalsuite.spec import StrictModel, TaskSpec
from evalsuite.task import Observation, RunContext, TaskResult, task


class Starts(StrictModel):
    first: int = 0
    step: int = 4096
    count: int = 8


class Scored(StrictModel):
    first: int = 256
    last: int = 510


class Protocol(StrictModel):
    window: int = 512
    starts: Starts = Starts()
    scored: Scored = Scored()
    add_special_tokens: bool = False


class RecordOptions(StrictModel):
    top_k: int = 64
    tail_samples: int = 64
    seed: int = 0


class CompareOptions(StrictModel):
    kld_chunk_rows: int = 16


class PplSpec(TaskSpec):
    protocol: Protocol = Protocol()
    record: RecordOptions = RecordOptions()
    compare: CompareOptions = CompareOptions()

    def model_post_init(self, _: Any) -> None:
        p = self.protocol
        if not 0 <= p.scored.first <= p.scored.last <= p.window - 2:
            raise ValueError(
                f"scored positions {p.scored.first}..{p.scored.last} must lie in 0..{p.window - 2}"
            )
        if p.starts.count < 1 or p.starts.step < p.window or p.starts.first < 0:
            raise ValueError("windows must not overlap: starts.step >= window, count >= 1, first >= 0")


def window_starts(spec: PplSpec, n_tokens: int) -> list[int]:
    """Start of every protocol window that fits entirely in `n_tokens` tokens."""
    s, w = spec.protocol.starts, spec.protocol.window
    starts = [s.first + i * s.step for i in range(s.count)]
    return [start for start in starts if start + w <= n_tokens]


# Logits are stored as the model produced them: bf16 logits as their raw 16 bits (numpy has no bfloat16).
STORED_DTYPES = {torch.bfloat16: "<u2", torch.float16: "<f2", torch.float32: "<f4"}


class LogitsFile:
    """Full-vocabulary logit rows of the scored positions in a .npy file, written and read in blocks of rows.

    The raw logits are stored, not log-probs: lossless at half the bytes of float32 for a bf16 model, and the
    comparison normalises them in float64. Plain reads and writes rather than a memory map: mapped pages count
    as resident memory, and on a 248 k vocabulary one side's file is 1 GB.
    """

    def __init__(self, fh: BinaryIO, shape: tuple[int, int], dtype: torch.dtype) -> None:
        self.fh = fh
        self.shape = shape
        self.dtype = dtype
        # Writes overlap the next window's forward pass; one write in flight bounds the memory held.
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="logits-writer")
        self._pending: Future[int] | None = None

    @classmethod
    def create(cls, path: Path, rows: int, vocab: int, dtype: torch.dtype) -> LogitsFile:
        if dtype not in STORED_DTYPES:
            raise InputError(f"cannot store logits of dtype {dtype}", path)
        fh = path.open("wb")
        header = {"descr": STORED_DTYPES[dtype], "fortran_order": False, "shape": (rows, vocab)}
        np.lib.format.write_array_header_1_0(fh, header)
        return cls(fh, (rows, vocab), dtype)

    @classmethod
    def open(cls, path: Path, dtype: torch.dtype) -> LogitsFile:
        fh = path.open("rb")
        fmt = np.lib.format
        version = fmt.read_magic(fh)
        read_header = {(1, 0): fmt.read_array_header_1_0, (2, 0): fmt.read_array_header_2_0}
        shape, fortran, descr = read_header[version](fh) if version in read_header else ((), True, None)
        if descr != np.dtype(STORED_DTYPES.get(dtype, "V1")) or fortran or len(shape) != 2:
            fh.close()
            raise InputError(f"not a row-major {dtype} logits array", path)
        return cls(fh, shape, dtype)

    def append(self, rows: torch.Tensor) -> None:
        if rows.dtype != self.dtype or tuple(rows.shape[1:]) != self.shape[1:]:
            raise ValueError(
                f"rows of {rows.dtype} {tuple(rows.shape)} do not fit a {self.dtype} {self.shape} file"
            )
        raw = rows.contiguous().view(torch.uint16) if rows.dtype == torch.bfloat16 else rows.contiguous()
        self.flush()
        self._pending = self._writer.submit(self.fh.write, memoryview(raw.numpy()))  # a view, not a copy

    def flush(self) -> None:
        """Wait for the write in flight; re-raises its error."""
        if self._pending is not None:
            self._pending.result()
            self._pending = None

    def close(self) -> None:
        try:
            self.flush()
        finally:
            self._writer.shutdown()
            self.fh.close()

    def chunks(self, n_rows: int) -> Iterator[torch.Tensor]:
        """Successive blocks of up to `n_rows` rows, read into one reused buffer (valid until the next)."""
        buffer = torch.empty((n_rows, self.shape[1]), dtype=self.dtype)
        raw = buffer.view(torch.uint16) if self.dtype == torch.bfloat16 else buffer
        for start in range(0, self.shape[0], n_rows):
            rows = min(n_rows, self.shape[0] - start)
            block = raw[:rows].numpy()
            if self.fh.readinto(memoryview(block).cast("B")) != block.nbytes:
                raise InputError("logits file is shorter than its header says", Path(self.fh.name))
            yield buffer[:rows]

    def __enter__(self) -> LogitsFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def log_softmax64(logits: torch.Tensor) -> np.ndarray:
    """Log-probabilities in float64 from stored logits."""
    return torch.log_softmax(logits.double(), dim=-1).numpy()


def tokens_sha256(tokens: np.ndarray) -> str:
    """Hash of the token ids fed to both sides (int64 little-endian)."""
    return hashlib.sha256(np.ascontiguousarray(tokens, dtype="<i8").tobytes()).hexdigest()


@task("ppl")
class Perplexity:
    """PPL of each side, ln(PPL ratio), KL divergence, same-top-token rate and Δp on the scored tokens."""

    needs_model: ClassVar[bool] = True
    spec_model: ClassVar[type[TaskSpec]] = PplSpec

    def __init__(self, spec: PplSpec, context: RunContext) -> None:
        self.spec = spec
        self.context = context

    @property
    def corpus(self) -> Corpus:
        return self.context.corpus

    def tokenize(self, side: Side) -> np.ndarray:
        ids = side.tokenizer(
            self.corpus.text, add_special_tokens=self.spec.protocol.add_special_tokens, verbose=False
        )["input_ids"]
        return np.asarray(ids, dtype=np.int64)

    def prepare(self, ref: Side, ckpt: Side) -> dict[str, Any]:
        """Tokenize once with the ref tokenizer; the candidate's tokenizer must give the same ids.

        A recorded reference has no tokenizer: the candidate's tokens are used, and the runner checks them
        against the recording's hash.
        """
        tokens = self.tokenize(ckpt if ref.is_recorded else ref)
        # Byte-identical tokenizer files give identical ids: the second tokenization would only cost time.
        if not ref.is_recorded and tokenizer_sha256(ref.checkpoint) != tokenizer_sha256(ckpt.checkpoint):
            other = self.tokenize(ckpt)
            if other.shape != tokens.shape or not np.array_equal(other, tokens):
                where = metrics.first_divergence(tokens, other)
                raise InputError(
                    f"its tokenizer disagrees with the reference's on the {self.corpus.name} text "
                    f"(first differing token at index {where}); the sides cannot be compared",
                    ckpt.checkpoint.path,
                )
        starts = window_starts(self.spec, len(tokens))
        if not starts:
            raise InputError(
                f"the {self.corpus.name} text has {len(tokens)} tokens, fewer than one "
                f"{self.spec.protocol.window}-token window"
            )
        w = self.spec.protocol.window
        windows = np.stack([tokens[s : s + w] for s in starts])
        return {
            "corpus": self.corpus.name,
            "corpus_sha256": self.corpus.sha256,
            "n_tokens_text": len(tokens),
            "starts": starts,
            "windows": windows,
            "tokens_sha256": tokens_sha256(windows),
        }

    def observe(self, side: Side, inputs: dict[str, Any], folder: Path) -> Observation:
        """Per scored token: NLL of the true next token, the top token, and the raw logits on disk."""
        p = self.spec.protocol.scored
        positions = torch.arange(p.first, p.last + 1)
        windows: np.ndarray = inputs["windows"]
        n_rows = len(windows) * len(positions)
        model = side.model
        nll = np.empty(n_rows, dtype=np.float64)
        top = np.empty(n_rows, dtype=np.int64)
        step = side.steps(f"{side.role}: ppl windows", len(windows))
        out: LogitsFile | None = None  # created at the first window, when the logits' dtype is known
        try:
            for w, window in enumerate(windows):
                ids = torch.from_numpy(window)
                logits = model.next_token_logits(ids, positions).cpu()
                if logits.shape != (len(positions), model.vocab_size):
                    raise InputError(
                        f"the model returned logits of shape {tuple(logits.shape)}, expected "
                        f"({len(positions)}, {model.vocab_size})",
                        side.checkpoint.path,
                    )
                if out is None:
                    out = LogitsFile.create(folder / "logits.npy", n_rows, model.vocab_size, logits.dtype)
                out.append(logits)
                lp = torch.log_softmax(logits, dim=-1, dtype=torch.float32)
                rows = slice(w * len(positions), (w + 1) * len(positions))
                targets = ids[positions + 1]
                nll[rows] = -lp.gather(1, targets[:, None])[:, 0].double().numpy()
                top[rows] = lp.argmax(dim=-1).numpy()
                step()
        finally:
            if out is not None:
                out.close()
        return Observation(
            task="ppl",
            key="",
            meta={
                "vocab_size": model.vocab_size,
                "logits_dtype": str(out.dtype).removeprefix("torch."),
                "n_windows": len(windows),
                "window_starts": list(inputs["starts"]),
                "tokens_sha256": inputs["tokens_sha256"],
                "corpus": inputs["corpus"],
                "n_tokens_text": inputs["n_tokens_text"],
            },
            arrays={"nll": nll, "top": top},
            files={"logits": folder / "logits.npy"},
        )

    def record(self, obs: Observation, folder: Path) -> Observation:
        """The compact form of a reference observation that a later comparison needs (no full logits).

        Per scored token: the true token's NLL, the top-k ids and log-probs, the probability mass outside the
        top-k, and `tail_samples` ids drawn (seeded) from the distribution restricted to that tail, with their
        log-probs: enough for an unbiased KL divergence against any candidate.
        """
        opts = self.spec.record
        generator = torch.Generator().manual_seed(opts.seed)
        parts: dict[str, list[torch.Tensor]] = {
            k: [] for k in ("top_ids", "top_logp", "tail_mass", "tail_ids", "tail_logp")
        }
        with LogitsFile.open(obs.files["logits"], getattr(torch, obs.meta["logits_dtype"])) as logits:
            for block in logits.chunks(self.spec.compare.kld_chunk_rows):
                lp = torch.log_softmax(block.double(), dim=-1)
                top_logp, top_ids = lp.topk(min(opts.top_k, lp.shape[-1]), dim=-1)
                tail = lp.scatter(1, top_ids, float("-inf"))
                tail_log_mass = torch.logsumexp(tail, dim=-1)
                parts["top_ids"].append(top_ids.int())
                parts["top_logp"].append(top_logp.float())
                parts["tail_mass"].append(tail_log_mass.exp())
                if opts.tail_samples and lp.shape[-1] > opts.top_k:
                    q = (tail - tail_log_mass[:, None]).exp()
                    ids = torch.multinomial(q, opts.tail_samples, replacement=True, generator=generator)
                else:
                    ids = torch.empty((len(lp), 0), dtype=torch.long)
                parts["tail_ids"].append(ids.int())
                parts["tail_logp"].append(lp.gather(1, ids).float())
        arrays = {k: torch.cat(v).numpy() for k, v in parts.items()}
        arrays.update(nll=obs.arrays["nll"], top=obs.arrays["top"])
        meta = {**obs.meta, "kind": "recorded", "top_k": opts.top_k, "tail_samples": opts.tail_samples}
        meta.pop("logits_dtype", None)
        return Observation(task="ppl", key=obs.key, meta=meta, arrays=arrays)

    def kld_from_recording(self, ref: Observation, ckpt: Observation) -> np.ndarray:
        """Per-token KLD against a recorded reference: exact over its top-k, an unbiased estimate beyond."""
        a = ref.arrays
        out = []
        step = self.spec.compare.kld_chunk_rows
        with LogitsFile.open(ckpt.files["logits"], getattr(torch, ckpt.meta["logits_dtype"])) as logits:
            for i, block in zip(range(0, logits.shape[0], step), logits.chunks(step), strict=True):
                rows = slice(i, i + len(block))
                lp = torch.log_softmax(block.double(), dim=-1)
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

    def kld_per_token(self, ref: Observation, ckpt: Observation) -> np.ndarray:
        """Full-vocabulary KLD of every scored token, streamed in chunks of rows from the two files."""
        with (
            LogitsFile.open(ref.files["logits"], getattr(torch, ref.meta["logits_dtype"])) as a,
            LogitsFile.open(ckpt.files["logits"], getattr(torch, ckpt.meta["logits_dtype"])) as b,
        ):
            if a.shape != b.shape:
                raise InputError(
                    f"the sides' log-prob arrays differ in shape: {a.shape} vs {b.shape} "
                    "(different vocabularies?)"
                )
            step = self.spec.compare.kld_chunk_rows
            return np.concatenate(
                [
                    metrics.kl_divergence(log_softmax64(x), log_softmax64(y))
                    for x, y in zip(a.chunks(step), b.chunks(step), strict=True)
                ]
            )

    def compare(self, ref: Observation, ckpt: Observation, artifacts: Path) -> TaskResult:
        for key in ("tokens_sha256", "vocab_size"):
            if ref.meta[key] != ckpt.meta[key]:
                raise InputError(
                    f"the sides were observed on different inputs ({key}: "
                    f"{ref.meta[key]} vs {ckpt.meta[key]})"
                )
        nll_ref, nll_ckpt = ref.arrays["nll"], ckpt.arrays["nll"]
        ln_ratio = metrics.paired_log_ratio(nll_ref, nll_ckpt)
        if ref.meta.get("kind") == "recorded":
            kld = self.kld_from_recording(ref, ckpt)
            estimator = (
                f"top-{ref.meta['top_k']} exact + {ref.meta['tail_samples']} sampled tail ids (recording)"
            )
        else:
            kld = self.kld_per_token(ref, ckpt)
            estimator = "full-vocabulary"
        kld_mean = metrics.mean_with_stderr(kld)
        kld_q = metrics.quantiles(kld, (0.5, 0.9, 0.99, 0.999))
        same_top = metrics.same_top_rate(ref.arrays["top"], ckpt.arrays["top"])
        dp = metrics.delta_p(-nll_ref, -nll_ckpt)
        ln_ppl_ref, ln_ppl_ckpt = metrics.ln_perplexity(nll_ref), metrics.ln_perplexity(nll_ckpt)
        values: dict[str, Any] = {
            "corpus": ref.meta["corpus"],
            "window_tokens": self.spec.protocol.window,
            "window_starts": ",".join(str(s) for s in ref.meta["window_starts"]),
            "scored_first": self.spec.protocol.scored.first,
            "scored_last": self.spec.protocol.scored.last,
            "n_windows": ref.meta["n_windows"],
            "n_scored_tokens": len(nll_ref),
            "tokens_sha256": ref.meta["tokens_sha256"],
            "ppl_ref": metrics.perplexity(nll_ref),
            "ppl_ref_stderr": metrics.perplexity(nll_ref) * ln_ppl_ref.stderr,
            "ppl_ckpt": metrics.perplexity(nll_ckpt),
            "ppl_ckpt_stderr": metrics.perplexity(nll_ckpt) * ln_ppl_ckpt.stderr,
            "ppl_ratio": float(np.exp(ln_ratio.value)),
            "ln_ppl_ratio": ln_ratio.value,
            "ln_ppl_ratio_stderr": ln_ratio.stderr,
            "kld_mean": kld_mean.value,
            "kld_mean_stderr": kld_mean.stderr,
            "kld_median": kld_q[0],
            "kld_p90": kld_q[1],
            "kld_p99": kld_q[2],
            "kld_p999": kld_q[3],
            "kld_max": float(kld.max()),
            "kld_estimator": estimator,
            "same_top_p": same_top.value,
            "same_top_p_stderr": same_top.stderr,
            "delta_p_mean": dp.mean.value,
            "delta_p_mean_stderr": dp.mean.stderr,
            "rms_delta_p": dp.rms.value,
            "rms_delta_p_stderr": dp.rms.stderr,
        }
        if ref.meta["n_windows"] < self.spec.protocol.starts.count:
            values["protocol_note"] = (
                f"text too short for the protocol: {ref.meta['n_windows']} of "
                f"{self.spec.protocol.starts.count} windows fit ({ref.meta['n_tokens_text']} tokens)"
            )
        checks = self.spec.threshold_checks(values)
        return TaskResult.from_checks(
            values, checks, artifacts=self.plot(ref, nll_ckpt, kld, estimator, artifacts)
        )

    def plot(
        self, ref: Observation, nll_ckpt: np.ndarray, kld: np.ndarray, estimator: str, folder: Path
    ) -> dict:
        """The KLD histogram and the per-window PPL of both sides; paths relative to the run folder."""
        ppl_ref = [metrics.perplexity(w) for w in np.split(ref.arrays["nll"], ref.meta["n_windows"])]
        ppl_ckpt = [metrics.perplexity(w) for w in np.split(nll_ckpt, ref.meta["n_windows"])]
        plots.kld_histogram(kld, folder / "ppl_kld_histogram.png", estimator)
        plots.window_ppl(ppl_ref, ppl_ckpt, ref.meta["window_starts"], folder / "ppl_window_ppl.png")
        return {
            "kld_histogram": f"{folder.name}/ppl_kld_histogram.png",
            "window_ppl": f"{folder.name}/ppl_window_ppl.png",
        }
