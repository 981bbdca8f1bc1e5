"""Greedy smoke prompts with expected answers, compared side by side, with the first divergence explained.

Both sides answer every prompt greedily and every outcome is read off those decoded answers
(`evalsuite.observers.greedy_answers`, paired by `evalsuite.tasks.answer_pairs`): each side's answer, pass or
fail, where the two part and how each side ranked the two tokens there. A loaded side decodes each prompt
alone (the answer a single request gets, the one shown) and in the spec's batch; a prompt whose answer moves
with the batch is marked `batch_sensitive` on that side, with both answers, and counted per side, the
reference's count the floor the candidate's is read against. A streamed side decodes in the spec's batch
only, and says so. Both sides are also forced along the reference's answer (`evalsuite.observers.
forced_answers`, one forward per prompt, in a streamed side's shared pass with `ppl`'s windows), for the
per-token KL divergence and same-top rate along it: figures labelled as forced, never an answer.

Trajectory survival (`survival_N`): over exactly the prompts whose budget (`max_new_tokens`) reaches N, the
share whose two answers agree for their first N tokens (two answers that end identically before N agree),
with a 95% Wilson interval over prompts (each prompt one independent outcome).

The calibration set kept apart (`--calibration`, `evalsuite.tasks.calibration_overlap`): each prompt's own
words (its turns' contents, without the chat template) are checked against it; where some prompt is flagged,
every figure is given without the flagged prompts too (`clean_…`), with the spec's thresholds applied to them.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, Literal

import numpy as np
from pydantic import field_validator, model_validator

from evalsuite.contract.observation import Observation
from evalsuite.contract.spec import Check, StrictModel, TaskSpec
from evalsuite.errors import InputError
from evalsuite.observers.forced_answers import (
    FORCED_LABEL,
    FORCED_REFERENCE_LABEL,
    ForcedAtReference,
    ForcedReference,
)
from evalsuite.observers.greedy_answers import ANSWERS_LABEL, PROMPTS, GreedyAnswers
from evalsuite.observers.kld_detail import kld_at_reference
from evalsuite.observers.window_logits import RecordOptions
from evalsuite.protocol.side import Side
from evalsuite.protocol.task import Inputs, Need, RunContext, TaskResult, skip_if_cannot_generate, task
from evalsuite.stats import metrics
from evalsuite.tasks.answer_pairs import (
    PairedAnswers,
    batch_cells,
    batch_sensitive,
    divergence_row,
    marked,
    paired_answers,
)
from evalsuite.tasks.calibration_overlap import (
    CalibrationOptions,
    Overlap,
    flagged_verdicts,
    overlap_metrics,
    overlap_rows,
    text_overlap,
)
from evalsuite.tasks.ppl_subsets import subset_checks

Category = Literal["factual", "code", "arithmetic", "chinese", "instruction", "mathematics", "chat"]


class Message(StrictModel):
    role: Literal["system", "user", "assistant"]
    content: str


class ChatPrompt(StrictModel):
    """A prompt a task asks both sides greedily (`smoke`, `specdec`): one user turn (`prompt`) or a whole chat
    (`messages`, ending with the user's turn), either way through the side's chat template with its
    generation prompt, and the tokens its answer may take."""

    id: str
    prompt: str | None = None
    messages: list[Message] | None = None
    max_new_tokens: int

    @field_validator("max_new_tokens")
    @classmethod
    def _positive(cls, value: int) -> int:
        if not 1 <= value <= 4096:
            raise ValueError("must be between 1 and 4096")
        return value

    @model_validator(mode="after")
    def _one_form(self) -> ChatPrompt:
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

    def template_options(self) -> dict[str, Any]:
        """What the chat template is rendered with beside the messages (none here)."""
        return {}


class Prompt(ChatPrompt):
    category: Category
    language: Literal["en", "zh"] = "en"
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
        refuse_repeated_ids(self.prompts)


def refuse_repeated_ids(prompts: Sequence[ChatPrompt]) -> None:
    """ValueError (a spec's validation error) where two prompts share an id."""
    ids = [p.id for p in prompts]
    if len(set(ids)) != len(ids):
        raise ValueError(f"prompt ids must be unique: {sorted({i for i in ids if ids.count(i) > 1})}")


def chat_ids(
    side: Side, chat: list[dict[str, str]], tools: list[dict[str, Any]] | None = None, **template: Any
) -> list[int]:
    """A chat through the side's chat template (generation prompt on; `tools` offered to the template where
    given; `template`: the template's own switches, `enable_thinking`), or, without a template, its turns'
    text one after the other."""
    tokenizer = side.tokenizer
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(
            chat, tools=tools, add_generation_prompt=True, tokenize=True, **template
        )
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    return list(tokenizer("\n".join(m["content"] for m in chat))["input_ids"])


def prompt_ids(side: Side, prompt: ChatPrompt, **template: Any) -> list[int]:
    """The prompt through the side's chat template (`chat_ids`), with the prompt's own `template_options`
    and then `template`'s switches."""
    return chat_ids(side, prompt.chat(), **{**prompt.template_options(), **template})


def agreed_ids(
    ref: Side, ckpt: Side, names: list[str], ids_of: Callable[[Side], list[list[int]]]
) -> list[list[int]]:
    """The prompts' token ids (`ids_of` a side), made once with the reference's tokenizer (the candidate's
    for a recorded reference). Where the two sides' tokenizer files differ, the candidate's must give the
    same ids for every prompt: InputError naming the first (by `names`) that it does not."""
    ids = ids_of(ckpt if ref.is_recorded else ref)
    if not ref.is_recorded and ref.checkpoint.tokenizer_sha256 != ckpt.checkpoint.tokenizer_sha256:
        for name, a, b in zip(names, ids, ids_of(ckpt), strict=True):
            if a != b:
                raise InputError(
                    f"its tokenizer or chat template disagrees with the reference's on prompt {name!r}; the "
                    "sides cannot be compared",
                    ckpt.checkpoint.path,
                )
    return ids


def shared_prompt_ids(
    ref: Side, ckpt: Side, prompts: Sequence[ChatPrompt], **template: Any
) -> list[list[int]]:
    """Each prompt's ids through the chat template (`template`: its switches), agreed by both sides
    (`agreed_ids`)."""
    names = [p.id for p in prompts]
    return agreed_ids(ref, ckpt, names, lambda side: [prompt_ids(side, p, **template) for p in prompts])


def ids_sha256(prompts: list[list[int]]) -> str:
    return hashlib.sha256(json.dumps(prompts).encode()).hexdigest()


CKPT_ANSWERS_LABEL = "ckpt-answers"


def smoke_needs(task: str, answers: GreedyAnswers, record: RecordOptions, full_steps: int = 0) -> list[Need]:
    """What a task that asks prompts of both sides observes (`smoke`, `vision`): each side's greedy answers,
    decoded (`answers`, the same observer on both sides), and both sides forced along the reference's answers
    for the KLD along them; the forced observers named for `task`."""
    return [
        Need(ANSWERS_LABEL, "ref", answers),
        Need(
            FORCED_REFERENCE_LABEL,
            "ref",
            ForcedReference(record, full_steps, task),
            consumes=(ANSWERS_LABEL,),
        ),
        Need(CKPT_ANSWERS_LABEL, "ckpt", answers),
        Need(
            FORCED_LABEL,
            "ckpt",
            ForcedAtReference(record, full_steps, task),
            consumes=(ANSWERS_LABEL, FORCED_REFERENCE_LABEL),
        ),
    ]


def batch_figures(pair: PairedAnswers) -> tuple[dict[str, Any], dict[str, str]]:
    """Each side's count of prompts whose answer depends on the batch, the exact McNemar p of the candidate's
    against the reference's (paired over prompts), and how each side's answers were decoded; a count a side
    could not measure (it decoded in one configuration) is None, with its reason."""
    values: dict[str, Any] = {
        "answers_compared": pair.describe(),
        "ref_answers_decoded": pair.ref_configuration.describe(),
        "ckpt_answers_decoded": pair.ckpt_configuration.describe(),
    }
    reasons: dict[str, str] = {}
    ref = batch_sensitive(pair.ref, pair.ref_other)
    ckpt = batch_sensitive(pair.ckpt, pair.ckpt_other)
    for side, found, configuration in (
        ("ref", ref, pair.ref_configuration),
        ("ckpt", ckpt, pair.ckpt_configuration),
    ):
        values[f"{side}_batch_sensitive"] = None if found is None else sum(found)
        if found is None:
            reasons[f"{side}_batch_sensitive"] = (
                f"this side was {configuration.describe()} only, so whether its answers depend on the batch "
                "was not measured"
            )
    if ref is not None and ckpt is not None:
        flips = metrics.flip_counts(np.logical_not(ref), np.logical_not(ckpt))
        values["batch_sensitivity_p"] = metrics.mcnemar_exact_p(flips.c2w, flips.w2c)
    else:
        values["batch_sensitivity_p"] = None
        reasons["batch_sensitivity_p"] = "a side's batch sensitivity was not measured"
    return values, reasons


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
        "near_ties",
        "ref_batch_sensitive",
        "ckpt_batch_sensitive",
        "batch_sensitivity_p",
        "kld_mean",
        "same_top_p",
        "survival_*",
        "clean_*",
        "calibration_*",
    )

    metric_descriptions: ClassVar[dict[str, str]] = {
        "n_prompts": "greedy prompts answered by both sides",
        "ref_pass": "prompts whose reference answer matches the expected answer",
        "ckpt_pass": "prompts whose candidate answer matches the expected answer",
        "identical": "prompts the two sides answered token for token the same",
        "diverged_outside_top5": "answers parting on a token outside the reference's top-5 at that step "
        "(a real divergence)",
        "ref_pass_ckpt_fail": "prompts the reference gets right and the candidate gets wrong",
        "near_ties": "divergences on a token inside the reference's top-5 that the reference's own decoding "
        "ranked below its token by less than `near_tie` nats at that step",
        "ref_batch_sensitive": "prompts whose reference answer decoded alone differs from its answer in the "
        "spec's batch",
        "ckpt_batch_sensitive": "prompts whose candidate answer decoded alone differs from its answer in the "
        "spec's batch",
        "batch_sensitivity_p": "exact McNemar p of the candidate's batch-sensitive prompts against the "
        "reference's, paired over prompts",
        "kld_mean": "mean KL(ref ‖ ckpt) over every token of the reference's answers, both sides forced "
        "along them (top-k exact, sampled tail), with its standard error over prompts: forced, not decoded",
        "same_top_p": "share of the reference's answer tokens where both sides, forced along it, rank the "
        "same token first: forced, not decoded",
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
        ids = shared_prompt_ids(ref, ckpt, self.spec.prompts)
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
        return smoke_needs("smoke", answers, self.spec.record)

    def compare(self, observed: Mapping[str, Observation], artifacts: Path) -> TaskResult:
        forced_ref, forced = observed[FORCED_REFERENCE_LABEL], observed[FORCED_LABEL]
        pair = paired_answers(observed[ANSWERS_LABEL], observed[CKPT_ANSWERS_LABEL])
        if len(pair) != len(self.spec.prompts):
            raise InputError(f"the sides answered {len(pair)} prompts, not {len(self.spec.prompts)}")
        rows = [self.compare_prompt(i, prompt, pair) for i, prompt in enumerate(self.spec.prompts)]
        # Every answer token's prompt, KL(ref ‖ ckpt) (the reference's compact rows against the candidate's
        # log-probs at their ids) and whether both sides rank the same token first: both forced along the
        # reference's answers.
        offsets = forced_ref.arrays["offsets"]
        along = {
            "prompt": np.repeat(np.arange(len(offsets) - 1), np.diff(offsets)),
            "kld": kld_at_reference(forced_ref, forced),
            "same_top": forced.arrays["same_top"].astype(np.float64),
        }
        keep = np.ones(len(rows), dtype=bool)
        values: dict[str, Any] = self.prompt_values(rows, keep, along)
        batch_values, null_reasons = batch_figures(pair)
        values.update(batch_values)
        values["kld_estimator"] = (
            f"top-{forced_ref.meta['top_k']} exact + {forced_ref.meta['tail_samples']} sampled tail ids, "
            "both sides forced along the reference's answers"
        )
        checks, _ = self.spec.threshold_checks(values)
        details = list(rows)
        if self.overlap is not None:
            values.update(overlap_metrics(self.overlap))
            details += overlap_rows(self.overlap)
            clean, clean_checks = self.without_flagged(checks, rows, along)
            values.update(clean)
            checks += clean_checks
        descriptions = {
            f"survival_{n}": f"share of the prompts whose budget reaches {n} tokens whose two answers agree "
            f"for their first {n}"
            for n in self.spec.survival.lengths
        }
        return TaskResult.from_checks(
            values, checks, details=details, null_reasons=null_reasons, descriptions=descriptions
        )

    def prompt_values(
        self, rows: list[dict[str, Any]], keep: np.ndarray, along: dict[str, np.ndarray]
    ) -> dict[str, Any]:
        """The figures of the prompts `keep` marks: how many pass on each side, how their answers part, the
        KLD along the reference's answers (`along`: per answer token, forced) and trajectory survival."""
        kept = [row for row, k in zip(rows, keep, strict=True) if k]
        values: dict[str, Any] = {
            "n_prompts": len(kept),
            "ref_pass": sum(row["ref_pass"] for row in kept),
            "ckpt_pass": sum(row["ckpt_pass"] for row in kept),
            "identical": sum(row["identical"] for row in kept),
            "diverged_outside_top5": sum(row["ckpt_token_in_ref_top5"] is False for row in kept),
            "ref_pass_ckpt_fail": sum(row["ref_pass"] and not row["ckpt_pass"] for row in kept),
            "near_ties": sum(bool(row.get("near_tie")) for row in kept),
        }
        values.update(_kld_along_answers(along, keep))
        values.update(self._survival(rows, keep))
        return values

    def without_flagged(
        self, checks: list[Check], rows: list[dict[str, Any]], along: dict[str, np.ndarray]
    ) -> tuple[dict[str, Any], list[Check]]:
        """The figures and the checks without the prompts the calibration set overlaps (`clean_…`), where
        some are flagged; and the verdict with and without them."""
        assert self.overlap is not None
        keep = ~self.overlap.flagged
        if keep.all():
            return {}, []
        if not keep.any():
            return {"clean_note": "every prompt overlaps the calibration set"}, []
        found = self.prompt_values(rows, keep, along)
        clean = {f"clean_{name}": value for name, value in found.items()}
        clean_checks = subset_checks(self.spec, "clean", clean)
        return {**clean, **flagged_verdicts(checks, clean_checks)}, clean_checks

    def _survival(self, rows: list[dict[str, Any]], keep: np.ndarray) -> dict[str, Any]:
        """`survival_N` for every configured N, over exactly the kept prompts whose budget reaches N: a prompt
        survives unless its answers part before token N (answers that end identically before N agree)."""
        out: dict[str, Any] = {}
        for n in self.spec.survival.lengths:
            seen = [
                row
                for row, prompt, k in zip(rows, self.spec.prompts, keep, strict=True)
                if k and prompt.max_new_tokens >= n
            ]
            survived = sum(row["first_diff_token"] is None or row["first_diff_token"] >= n for row in seen)
            share, low, high = metrics.proportion_interval(survived, len(seen))
            out.update({f"survival_{n}": share, f"survival_{n}_lower95": low, f"survival_{n}_upper95": high})
            out[f"survival_{n}_n"] = len(seen)
        return out

    def compare_prompt(self, i: int, prompt: Prompt, pair: PairedAnswers) -> dict[str, Any]:
        """One prompt: both answers as decoded, pass/fail, the reference's view at the first token they part
        on, and each side's answer in its batch where it differs from its answer alone."""
        ref_text, ckpt_text = pair.ref.texts[i], pair.ckpt.texts[i]
        d = pair.step(i)
        row: dict[str, Any] = {
            "id": prompt.id,
            "category": prompt.category,
            "language": prompt.language,
            "ref_answer": marked(ref_text, pair.ref.char_ends[i], d),
            "ckpt_answer": marked(ckpt_text, pair.ckpt.char_ends[i], d),
            "ref_pass": prompt.matches(ref_text),
            "ckpt_pass": prompt.matches(ckpt_text),
            "identical": d is None,
            "first_diff_token": d,
            "ckpt_token_in_ref_top5": None,
            "ref_logp_gap": None,
            "divergence": "",
        }
        row.update(divergence_row(pair, i, self.spec.generation.top_k, self.spec.generation.near_tie))
        row.update(batch_cells(pair, i, {"pass": prompt.matches}))
        return row


def _kld_along_answers(along: dict[str, np.ndarray], keep: np.ndarray) -> dict[str, Any]:
    """KL(ref ‖ ckpt) over every answer token of the prompts `keep` marks, its mean with a standard error
    clustered by prompt, and the same-top rate (both sides forced along the reference's answers)."""
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
