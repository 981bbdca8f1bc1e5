"""Greedy smoke prompts with expected answers, compared side by side, with the first divergence explained.

The reference answers every prompt greedily (`GreedyAnswers`, in batches: loaded, or streamed one decoder
layer at a time per new token, or replayed from a recording). The candidate is not asked to generate: its
greedy answer equals the reference's for as long as, fed the reference's answer so far, its most probable
token is the reference's next token, so the reference's answers are forced through it, in the same streamed
pass as `ppl`'s windows (`evalsuite.observers.forced_answers`); only a prompt where it parts is decoded on,
from the divergence (`Continuations`), so that its answer is still judged against `expect` and `reject`.

Trajectory survival (`survival_N`): the share of prompts whose two greedy answers agree for their first N
tokens, with a 95% Wilson interval over prompts (each prompt one independent outcome). A prompt whose
answers are both shorter than N and agree throughout survives; one whose reference answer was cut at its
`max_new_tokens` before N is left out of N's count (`survival_N_n` says how many prompts it rests on).

The calibration set kept apart (`--calibration`, `evalsuite.tasks.calibration_overlap`): each prompt's own
words (its turns' contents, without the chat template) are checked against it; where some prompt is flagged,
every figure is given without the flagged prompts too (`clean_…`), with the spec's thresholds applied to them.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar, Literal

import numpy as np
from pydantic import field_validator, model_validator

from evalsuite import metrics
from evalsuite.errors import InputError
from evalsuite.observation import Observation
from evalsuite.observers.forced_answers import (
    FORCED_LABEL,
    FORCED_REFERENCE_LABEL,
    Continuations,
    ForcedAtReference,
    ForcedReference,
    PromptDivergence,
    divergences,
    path_noise,
)
from evalsuite.observers.greedy_answers import ANSWERS_LABEL, PROMPTS, GreedyAnswers
from evalsuite.observers.kld_detail import kld_at_reference
from evalsuite.observers.window_logits import RecordOptions
from evalsuite.side import Side
from evalsuite.spec import Check, StrictModel, TaskSpec
from evalsuite.task import Inputs, Need, RunContext, TaskResult, skip_if_cannot_generate, task
from evalsuite.tasks.calibration_overlap import (
    CalibrationOptions,
    Overlap,
    flagged_verdicts,
    overlap_metrics,
    overlap_rows,
    text_overlap,
)
from evalsuite.tasks.ppl_subsets import subset_checks

DIVERGENCE_MARK = "⟦"  # where the two answers part, inside each answer in report.md
Category = Literal["factual", "code", "arithmetic", "chinese", "instruction", "mathematics", "chat"]


class Message(StrictModel):
    role: Literal["system", "user", "assistant"]
    content: str


class Prompt(StrictModel):
    id: str
    category: Category
    language: Literal["en", "zh"] = "en"
    # One user turn (`prompt`), or a whole chat (`messages`, ending with the user's turn): either way through
    # the side's chat template, with its generation prompt.
    prompt: str | None = None
    messages: list[Message] | None = None
    max_new_tokens: int
    expect: str
    # An answer that also matches `reject` fails: "Jupiter, but it's actually Saturn" names the expected
    # word and still answers wrongly.
    reject: str | None = None

    @field_validator("expect", "reject")
    @classmethod
    def _compiles(cls, value: str | None) -> str | None:
        if value is None:
            return value
        try:
            re.compile(value)
        except re.error as exc:
            raise ValueError(f"not a valid regular expression: {exc}") from None
        return value

    @field_validator("max_new_tokens")
    @classmethod
    def _positive(cls, value: int) -> int:
        if not 1 <= value <= 4096:
            raise ValueError("must be between 1 and 4096")
        return value

    @model_validator(mode="after")
    def _one_form(self) -> Prompt:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of `prompt` (one user turn) and `messages` (a chat)")
        if self.messages is not None and (not self.messages or self.messages[-1].role != "user"):
            raise ValueError("`messages` must end with the user's turn")
        return self

    def chat(self) -> list[dict[str, str]]:
        """The prompt as chat messages."""
        if self.messages is not None:
            return [m.model_dump() for m in self.messages]
        return [{"role": "user", "content": self.prompt or ""}]

    def text(self) -> str:
        """The prompt's own words: its turns' contents one after the other, without any chat template."""
        return "\n".join(m["content"] for m in self.chat())

    def matches(self, answer: str) -> bool:
        """The answer holds the expected answer and nothing the prompt rejects (case-insensitive)."""
        if self.reject is not None and re.search(self.reject, answer, flags=re.IGNORECASE):
            return False
        return re.search(self.expect, answer, flags=re.IGNORECASE) is not None


class GenerationOptions(StrictModel):
    top_k: int = 5
    near_tie: float = 1.0
    # Prompts decoded together (one forward per new token for all of them: a streamed side reads each layer
    # once per step whatever the batch).
    batch: int = 32

    @field_validator("batch", "top_k")
    @classmethod
    def _positive_count(cls, value: int) -> int:
        if value < 1:
            raise ValueError("must be at least 1")
        return value


class SurvivalOptions(StrictModel):
    # Answer lengths at which trajectory survival is reported.
    lengths: tuple[int, ...] = (8, 16, 32)


class SmokeSpec(TaskSpec):
    generation: GenerationOptions = GenerationOptions()
    survival: SurvivalOptions = SurvivalOptions()
    # What the reference's forced rows keep for the KLD along the answers (top-k exact, sampled beyond).
    record: RecordOptions = RecordOptions()
    # Compare-only: it reads the calibration set against the prompts, and shapes no observation.
    calibration: CalibrationOptions = CalibrationOptions()
    prompts: list[Prompt]

    COMPARE_ONLY: ClassVar[frozenset[str]] = TaskSpec.COMPARE_ONLY | {"calibration"}

    def model_post_init(self, _: Any) -> None:
        ids = [p.id for p in self.prompts]
        if len(set(ids)) != len(ids):
            raise ValueError(f"prompt ids must be unique: {sorted({i for i in ids if ids.count(i) > 1})}")


def prompt_ids(side: Side, prompt: Prompt) -> list[int]:
    """The prompt through the side's chat template (generation prompt on), or, without a template, its turns'
    text one after the other."""
    tokenizer = side.tokenizer
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(prompt.chat(), add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    return list(tokenizer(prompt.text())["input_ids"])


def ids_sha256(prompts: list[list[int]]) -> str:
    return hashlib.sha256(json.dumps(prompts).encode()).hexdigest()


def smoke_needs(
    task: str, answers: Any, record: RecordOptions, top_k: int, batch: int, full_steps: int = 0
) -> list[Need]:
    """What a task that asks prompts of both sides observes (`smoke`, `vision`): the reference's greedy
    answers, both sides forced along them, and the candidate's own answer after a divergence; the observers
    named for `task`."""
    return [
        Need(ANSWERS_LABEL, "ref", answers),
        Need(
            FORCED_REFERENCE_LABEL,
            "ref",
            ForcedReference(record, full_steps, task),
            consumes=(ANSWERS_LABEL,),
        ),
        Need(
            FORCED_LABEL,
            "ckpt",
            ForcedAtReference(record, full_steps, task),
            consumes=(ANSWERS_LABEL, FORCED_REFERENCE_LABEL),
        ),
        Need(
            CONTINUED_LABEL,
            "ckpt",
            Continuations(top_k, batch, task),
            consumes=(ANSWERS_LABEL, FORCED_REFERENCE_LABEL, FORCED_LABEL),
        ),
    ]


CONTINUED_LABEL = "continued"


@task("smoke")
class Smoke:
    """Greedy answers of both sides to the spec's prompts: pass/fail per side, where they diverge and how
    long they agree (module docstring)."""

    spec_model: ClassVar[type[TaskSpec]] = SmokeSpec
    metric_names: ClassVar[tuple[str, ...]] = (
        "n_prompts",
        "ref_pass",
        "ckpt_pass",
        "identical",
        "diverged_outside_top5",
        "ref_pass_ckpt_fail",
        "near_ties_within_resolution",
        "path_noise",
        "kld_mean",
        *(f"survival_{n}{suffix}" for n in (8, 16, 32) for suffix in ("", "_lower95", "_upper95", "_n")),
        "clean_*",
        "calibration_*",
    )

    metric_descriptions: ClassVar[dict[str, str]] = {
        "n_prompts": "greedy prompts answered by both sides",
        "ref_pass": "prompts whose reference answer matches the expected answer",
        "ckpt_pass": "prompts whose candidate answer matches the expected answer",
        "identical": "prompts answered token for token the same",
        "diverged_outside_top5": "answers parting on a token outside the reference's top-5 (real divergence)",
        "ref_pass_ckpt_fail": "prompts the reference gets right and the candidate gets wrong",
        "near_ties_within_resolution": (
            "divergences where the candidate prefers its token by no more than its logits' resolution or "
            "twice `path_noise`: its own decoding may choose either"
        ),
        "path_noise": (
            "largest difference between the reference's decoding and its forced forward in the log-prob of a "
            "token it chose (nats): how far the two paths' arithmetic moves a log-prob"
        ),
        "kld_mean": (
            "mean KL(ref ‖ ckpt) over every token of the reference's answers, both sides forced along them "
            "(top-k exact, sampled tail), with its standard error over prompts"
        ),
        **{
            f"survival_{n}": f"share of prompts whose two greedy answers agree for their first {n} tokens"
            for n in (8, 16, 32)
        },
        "calibration_overlap_share": "share of the prompts' tokens (their own words, without the chat "
        "template) in a 13-gram the calibration set holds, or in a shorter prompt found whole in it",
        "calibration_flagged_prompts": "prompts whose overlap with the calibration set exceeds the spec's "
        "share; clean_* are the figures (and checks) without them",
    }

    def __init__(self, spec: SmokeSpec, context: RunContext) -> None:
        self.spec = spec
        self.context = context
        # The overlap of each prompt with the calibration set, found by `prepare`.
        self.overlap: Overlap | None = None

    def prepare(self, ref: Side, ckpt: Side) -> Inputs:
        """Prompt ids made once (with the reference tokenizer), hashed; the candidate must agree. Each
        prompt's overlap with the calibration set, if one is given or named."""
        skip_if_cannot_generate(ref, ckpt, "smoke")
        source = ckpt if ref.is_recorded else ref
        ids = [prompt_ids(source, p) for p in self.spec.prompts]
        if not ref.is_recorded and ref.checkpoint.tokenizer_sha256 != ckpt.checkpoint.tokenizer_sha256:
            other = [prompt_ids(ckpt, p) for p in self.spec.prompts]
            for prompt, a, b in zip(self.spec.prompts, ids, other, strict=True):
                if a != b:
                    raise InputError(
                        f"its tokenizer or chat template disagrees with the reference's on prompt "
                        f"{prompt.id!r}; the sides cannot be compared",
                        ckpt.checkpoint.path,
                    )
        prompts = [
            {"ids": i, "max_new_tokens": p.max_new_tokens}
            for i, p in zip(ids, self.spec.prompts, strict=True)
        ]
        texts = {p.id: p.text() for p in self.spec.prompts}
        self.overlap = text_overlap(self.spec.calibration, self.context, ref, ckpt, texts, "prompt")
        return {PROMPTS: prompts, "prompts_sha256": ids_sha256(ids), "n_prompts": len(ids)}

    def needs(self) -> list[Need]:
        g = self.spec.generation
        # The expected answers are compare-only: changing a regex never re-runs a model.
        identity = {
            "prompts": [
                p.model_dump(
                    mode="json", include={"id", "prompt", "messages", "max_new_tokens"}, exclude_none=True
                )
                for p in self.spec.prompts
            ]
        }
        answers = GreedyAnswers("smoke-answers", "smoke prompts", identity, g.top_k, 0, g.batch)
        return smoke_needs("smoke", answers, self.spec.record, g.top_k, g.batch)

    def compare(self, observed: Mapping[str, Observation], artifacts: Path) -> TaskResult:
        ref, forced_ref = observed[ANSWERS_LABEL], observed[FORCED_REFERENCE_LABEL]
        forced, ckpt = observed[FORCED_LABEL], observed[CONTINUED_LABEL]
        # The two paths' difference, measured on each side: the reference's answers, the candidate's
        # continuations.
        noise = max(path_noise(ref, forced_ref), float(ckpt.meta.get("path_noise", 0.0)))
        parts = divergences(forced_ref, forced, noise)
        rows = [
            self.compare_prompt(i, prompt, ref, forced_ref, forced, ckpt, parts[i])
            for i, prompt in enumerate(self.spec.prompts)
        ]
        # Every answer token's prompt, KL(ref ‖ ckpt) (the reference's compact rows against the candidate's
        # log-probs at their ids) and whether both sides rank the same token first.
        offsets = forced_ref.arrays["offsets"]
        along = {
            "prompt": np.repeat(np.arange(len(offsets) - 1), np.diff(offsets)),
            "kld": kld_at_reference(forced_ref, forced),
            "same_top": forced.arrays["same_top"].astype(np.float64),
        }
        keep = np.ones(len(rows), dtype=bool)
        values: dict[str, Any] = self.prompt_values(rows, keep, ref, parts, along)
        values["path_noise"] = noise
        values["kld_estimator"] = (
            f"top-{forced_ref.meta['top_k']} exact + {forced_ref.meta['tail_samples']} sampled tail ids"
        )
        checks, _ = self.spec.threshold_checks(values)
        details = list(rows)
        if self.overlap is not None:
            values.update(overlap_metrics(self.overlap))
            details += overlap_rows(self.overlap)
            clean, clean_checks = self.without_flagged(checks, rows, ref, parts, along)
            values.update(clean)
            checks += clean_checks
        return TaskResult.from_checks(values, checks, details=details)

    def prompt_values(
        self,
        rows: list[dict[str, Any]],
        keep: np.ndarray,
        ref: Observation,
        parts: list[PromptDivergence],
        along: dict[str, np.ndarray],
    ) -> dict[str, Any]:
        """The figures of the prompts `keep` marks: how many pass on each side, how their answers part, the
        KLD along the reference's answers (`along`: per answer token) and trajectory survival."""
        kept = [row for row, k in zip(rows, keep, strict=True) if k]
        values: dict[str, Any] = {
            "n_prompts": len(kept),
            "ref_pass": sum(row["ref_pass"] for row in kept),
            "ckpt_pass": sum(row["ckpt_pass"] for row in kept),
            "identical": sum(row["identical"] for row in kept),
            "diverged_outside_top5": sum(row["ckpt_token_in_ref_top5"] is False for row in kept),
            "ref_pass_ckpt_fail": sum(row["ref_pass"] and not row["ckpt_pass"] for row in kept),
            "near_ties_within_resolution": sum(bool(row.get("within_resolution")) for row in kept),
        }
        values.update(_kld_along_answers(along, keep))
        values.update(self._survival(ref, parts, keep))
        return values

    def without_flagged(
        self,
        checks: list[Check],
        rows: list[dict[str, Any]],
        ref: Observation,
        parts: list[PromptDivergence],
        along: dict[str, np.ndarray],
    ) -> tuple[dict[str, Any], list[Check]]:
        """The figures and the checks without the prompts the calibration set overlaps (`clean_…`), where
        some are flagged; and the verdict with and without them."""
        assert self.overlap is not None
        keep = ~self.overlap.flagged
        if keep.all():
            return {}, []
        if not keep.any():
            return {"clean_note": "every prompt overlaps the calibration set"}, []
        found = self.prompt_values(rows, keep, ref, parts, along)
        clean = {f"clean_{name}": value for name, value in found.items()}
        clean_checks = subset_checks(self.spec, "clean", clean)
        return {**clean, **flagged_verdicts(checks, clean_checks)}, clean_checks

    def _survival(self, ref: Observation, parts: list[PromptDivergence], keep: np.ndarray) -> dict[str, Any]:
        offsets = ref.arrays["offsets"]
        out: dict[str, Any] = {}
        for n in self.spec.survival.lengths:
            survived = seen = 0
            for i, prompt in enumerate(self.spec.prompts):
                if not keep[i]:
                    continue
                length = int(offsets[i + 1] - offsets[i])
                ended = length < prompt.max_new_tokens  # a stop token ended the answer
                if parts[i].step is not None and parts[i].step < n:
                    seen += 1
                elif length >= n or ended:
                    seen += 1
                    survived += 1
            share, low, high = metrics.proportion_interval(survived, seen)
            out.update({f"survival_{n}": share, f"survival_{n}_lower95": low, f"survival_{n}_upper95": high})
            out[f"survival_{n}_n"] = seen
        return out

    def compare_prompt(
        self,
        i: int,
        prompt: Prompt,
        ref: Observation,
        forced_ref: Observation,
        forced: Observation,
        ckpt: Observation,
        part: PromptDivergence,
    ) -> dict[str, Any]:
        """One prompt: both answers, pass/fail, and the reference's view at the first token they part on."""
        ref_text, ckpt_text = ref.meta["texts"][i], ckpt.meta["texts"][i]
        d = part.step
        row: dict[str, Any] = {
            "id": prompt.id,
            "category": prompt.category,
            "language": prompt.language,
            "ref_answer": ref_text,
            "ckpt_answer": ckpt_text,
            "ref_pass": prompt.matches(ref_text),
            "ckpt_pass": prompt.matches(ckpt_text),
            "identical": d is None,
            "first_diff_token": d,
            "ckpt_token_in_ref_top5": None,
            "ref_logp_gap": None,
            "divergence": "",
        }
        if part.reference_ties:
            row["reference_ties"] = ", ".join(map(str, part.reference_ties))
        if part.fragile:
            # Where forcing says "the same token" by less than the logits' resolution: decoding may part.
            row["agreement_within_resolution"] = ", ".join(map(str, part.fragile))
        if d is None:
            return row
        for side, obs, text in (("ref_answer", ref, ref_text), ("ckpt_answer", ckpt, ckpt_text)):
            cut = obs.meta["char_ends"][i][d - 1] if d > 0 else 0
            row[side] = f"{text[:cut]}{DIVERGENCE_MARK}{text[cut:]}"
        r = int(forced_ref.arrays["offsets"][i]) + d
        top_ids, top_logp = forced_ref.arrays["top_ids"][r], forced_ref.arrays["top_logp"][r]
        chosen, k = int(part.chosen), self.spec.generation.top_k
        inside = bool(chosen in top_ids[:k])
        ids = list(top_ids)
        # The reference's preference for its own token over the candidate's: small is a near tie, large an
        # error. Beyond the kept ids only a lower bound is known (the gap to the last one kept).
        own = float(forced_ref.arrays["target_logp"][r])
        gap = own - float(top_logp[ids.index(chosen)] if chosen in ids else top_logp[-1])
        near = inside and gap < self.spec.generation.near_tie
        step = int(ref.arrays["offsets"][i]) + d
        row.update(
            ckpt_token_in_ref_top5=inside,
            ref_logp_gap=gap if chosen in ids else f">= {gap:.4g}",
            ckpt_logp_gap=part.gap,
            within_resolution=part.below_resolution,
            divergence=(
                ("near tie within the decoding paths' difference" if part.below_resolution else "near tie")
                if near or part.below_resolution
                else "real divergence"
            )
            + f" at token {d}",
            ref_top5=", ".join(
                f"{text!r} {float(lp):.3g}"
                for text, lp in zip(ref.meta["top_text"][i][d], ref.arrays["top_logp"][step], strict=True)
            ),
            # The tokens each side chose, as text (from where each token ends in its answer).
            ref_token=repr(_token_text(ref, i, d, ref_text)),
            ckpt_token=repr(_token_text(ckpt, i, d, ckpt_text)),
        )
        return row


def _kld_along_answers(along: dict[str, np.ndarray], keep: np.ndarray) -> dict[str, Any]:
    """KL(ref ‖ ckpt) over every answer token of the prompts `keep` marks, its mean with a standard error
    clustered by prompt, and the same-top rate."""
    kept = keep[along["prompt"]]
    kld, same, clusters = along["kld"][kept], along["same_top"][kept], along["prompt"][kept]
    if not len(kld):
        return {"kld_mean": float("nan"), "kld_mean_stderr": float("nan")}
    mean, stderr = float(kld.mean()), metrics.clustered_stderr(kld, clusters)
    same_mean, same_err = float(same.mean()), metrics.clustered_stderr(same, clusters)
    return {
        "kld_mean": mean,
        "kld_mean_stderr": stderr,
        "same_top_p": same_mean,
        "same_top_p_stderr": same_err,
        "answer_tokens": len(kld),
    }


def _token_text(obs: Observation, prompt: int, step: int, text: str) -> str:
    """The text of the token an answer chose at `step`."""
    ends = obs.meta["char_ends"][prompt]
    start = ends[step - 1] if step > 0 else 0
    return text[start : ends[step]]
