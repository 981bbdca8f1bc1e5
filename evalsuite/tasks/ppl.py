"""Perplexity and next-token agreement on fixed windows of a text (the WikiText-2 protocol)."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

from evalsuite import metrics
from evalsuite.corpus import Corpus
from evalsuite.errors import InputError
from evalsuite.side import Side
from evalsuite.spec import StrictModel, TaskSpec, apply_threshold
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


class CompareOptions(StrictModel):
    kld_chunk_rows: int = 64


class PplSpec(TaskSpec):
    protocol: Protocol = Protocol()
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
        """Tokenize once with the ref tokenizer; the candidate's tokenizer must give the same ids."""
        tokens = self.tokenize(ref)
        if ckpt is not ref:
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
        """Per scored token: NLL of the true next token, the top token, and the full log-prob row on disk."""
        p = self.spec.protocol.scored
        positions = torch.arange(p.first, p.last + 1)
        windows: np.ndarray = inputs["windows"]
        n_rows = len(windows) * len(positions)
        model = side.model
        logprobs = np.lib.format.open_memmap(
            folder / "logprobs.npy", mode="w+", dtype=np.float32, shape=(n_rows, model.vocab_size)
        )
        nll = np.empty(n_rows, dtype=np.float64)
        top = np.empty(n_rows, dtype=np.int64)
        step = side.steps(f"{side.role}: ppl windows", len(windows))
        for w, window in enumerate(windows):
            ids = torch.from_numpy(window)
            lp = side.model.next_token_logprobs(ids, positions).cpu()
            if lp.shape[-1] != model.vocab_size:
                raise InputError(
                    f"the model returned {lp.shape[-1]} logits, not its vocabulary size {model.vocab_size}",
                    side.checkpoint.path,
                )
            rows = slice(w * len(positions), (w + 1) * len(positions))
            targets = ids[positions + 1]
            logprobs[rows] = lp.numpy()
            nll[rows] = -lp.gather(1, targets[:, None])[:, 0].double().numpy()
            top[rows] = lp.argmax(dim=-1).numpy()
            step()
        logprobs.flush()
        del logprobs
        return Observation(
            task="ppl",
            key="",
            meta={
                "vocab_size": model.vocab_size,
                "n_windows": len(windows),
                "tokens_sha256": inputs["tokens_sha256"],
                "corpus": inputs["corpus"],
                "n_tokens_text": inputs["n_tokens_text"],
            },
            arrays={"nll": nll, "top": top},
            files={"logprobs": folder / "logprobs.npy"},
        )

    def kld_per_token(self, ref: Observation, ckpt: Observation) -> np.ndarray:
        """Full-vocabulary KLD of every scored token, streamed in chunks of rows from the two files."""
        a = np.load(ref.files["logprobs"], mmap_mode="r")
        b = np.load(ckpt.files["logprobs"], mmap_mode="r")
        if a.shape != b.shape:
            raise InputError(
                f"the sides' log-prob arrays differ in shape: {a.shape} vs {b.shape} "
                "(different vocabularies?)"
            )
        step = self.spec.compare.kld_chunk_rows
        return np.concatenate(
            [metrics.kl_divergence(a[i : i + step], b[i : i + step]) for i in range(0, len(a), step)]
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
        kld = self.kld_per_token(ref, ckpt)
        kld_mean = metrics.mean_with_stderr(kld)
        kld_q = metrics.quantiles(kld, (0.5, 0.9, 0.99, 0.999))
        same_top = metrics.same_top_rate(ref.arrays["top"], ckpt.arrays["top"])
        dp = metrics.delta_p(-nll_ref, -nll_ckpt)
        ln_ppl_ref, ln_ppl_ckpt = metrics.ln_perplexity(nll_ref), metrics.ln_perplexity(nll_ckpt)
        values: dict[str, Any] = {
            "corpus": ref.meta["corpus"],
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
            "kld_estimator": "full-vocabulary",
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
        checks = [
            c for name, t in self.spec.thresholds.items() for c in apply_threshold(name, values.get(name), t)
        ]
        return TaskResult.from_checks(values, checks)
