"""Long greedy answers: does the candidate still stop, stay out of loops, write valid text in the prompt's
language and reach the right final answer where the reference does?

Both sides answer the spec's prompts greedily, through the chat template, up to a budget (512 new tokens by
default), and every outcome is read off the answers each side decoded (`evalsuite.observers.greedy_answers`,
paired by `evalsuite.tasks.answer_pairs`, as `smoke`'s are): alone where the side is loaded, in the spec's
batch where it streams, the configuration stated. For a chat template that takes `enable_thinking`, every
prompt is asked in both modes; the thinking mode's figures are named `thinking_…`, and its thought (up to
`</think>`) is measured apart from the answer after it.

Per prompt and side (`evalsuite.stats.answers`): stopped by EOS or by the budget; the length in tokens; a loop
(the last 64 tokens periodic with a period of at most 32); U+FFFD in the text and invalid UTF-8 in the
answer's bytes (where the tokenizer gives bytes); whether the answer's prose is in the prompt's language (the
share of its letters in the language's script); the final answer right (`expect` / `reject`, as `smoke`'s).
Paired over prompts (`evalsuite.tasks.long_answers`): the flips of right and of looped (exact McNemar), and
the length ratio as a paired log-ratio with its 95% interval.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import field_validator

from evalsuite.contract.observation import Observation
from evalsuite.contract.spec import StrictModel, TaskSpec
from evalsuite.errors import InputError
from evalsuite.observers.greedy_answers import ANSWERS_LABEL, PROMPTS, AnswerSet, GreedyAnswers
from evalsuite.protocol.side import Side
from evalsuite.protocol.task import (
    Difference,
    Inputs,
    Need,
    RunContext,
    TaskResult,
    skip_if_cannot_generate,
    task,
)
from evalsuite.stats import answers
from evalsuite.tasks.answer_pairs import batch_sensitive, paired_answers
from evalsuite.tasks.long_answers import (
    DESCRIPTIONS,
    DIFFERENCES,
    THINKING,
    Reading,
    mode_values,
    stop_ids,
    vocabulary_bytes,
)
from evalsuite.tasks.ppl_subsets import subset_checks
from evalsuite.tasks.smoke import CKPT_ANSWERS_LABEL, Prompt, batch_figures, ids_sha256, shared_prompt_ids

Category = Literal["mathematics", "code", "explanation", "repetition"]


class LongPrompt(Prompt):
    """A prompt in `smoke`'s format whose budget is the spec's unless it gives its own."""

    category: Category  # type: ignore[assignment]
    max_new_tokens: int | None = None  # type: ignore[assignment]


class LongGeneration(StrictModel):
    max_new_tokens: int = 512
    top_k: int = 5
    batch: int = 32

    @field_validator("max_new_tokens", "top_k", "batch")
    @classmethod
    def _positive(cls, value: int) -> int:
        if value < 1:
            raise ValueError("must be at least 1")
        return value


class LanguageOptions(StrictModel):
    # An answer is in the prompt's language when at least this share of its prose's letters is in its script.
    min_share: float = 0.5

    @field_validator("min_share")
    @classmethod
    def _share(cls, value: float) -> float:
        if not 0 < value <= 1:
            raise ValueError("must be in (0, 1]")
        return value


class LongformSpec(TaskSpec):
    generation: LongGeneration = LongGeneration()
    language: LanguageOptions = LanguageOptions()
    prompts: list[LongPrompt]

    COMPARE_ONLY: ClassVar[frozenset[str]] = TaskSpec.COMPARE_ONLY | {"language"}

    def model_post_init(self, _: Any) -> None:
        ids = [p.id for p in self.prompts]
        if len(set(ids)) != len(ids):
            raise ValueError(f"prompt ids must be unique: {sorted({i for i in ids if ids.count(i) > 1})}")

    def budget(self, prompt: LongPrompt) -> int:
        """A prompt's token budget: its own, else the spec's."""
        return prompt.max_new_tokens or self.generation.max_new_tokens


@dataclass(frozen=True)
class Mode:
    """One way the prompts are asked: its name, the prefix of its figures and the template's switches."""

    name: str
    prefix: str
    template: dict[str, Any]

    @property
    def thinks(self) -> bool:
        return bool(self.template.get("enable_thinking"))


def modes_of(tokenizer: Any) -> list[Mode]:
    """Both modes where the chat template takes `enable_thinking` (its source names it), else one."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str) and "enable_thinking" in template:
        return [
            Mode("answer", "", {"enable_thinking": False}),
            Mode(THINKING, f"{THINKING}_", {"enable_thinking": True}),
        ]
    return [Mode("answer", "", {})]


@task("longform")
class Longform:
    """Long greedy answers of both sides: stops, loops, invalid text, language, final answers and lengths,
    paired over prompts (module docstring)."""

    spec_model: ClassVar[type[TaskSpec]] = LongformSpec
    metric_names: ClassVar[tuple[str, ...]] = (
        "n_prompts",
        "*_ref",
        "*_ckpt",
        "ckpt_*_not_ref",
        "ref_*_not_ckpt",
        "right_*",
        "loop_*",
        "language_*",
        "length_*",
        "thought_*",
        "thinking_*",
    )
    metric_descriptions: ClassVar[dict[str, str]] = DESCRIPTIONS

    def __init__(self, spec: LongformSpec, context: RunContext) -> None:
        self.spec = spec
        self.context = context
        # Set by `prepare` from the files: the modes, the stop tokens, each token's bytes, and per (mode,
        # prompt) whether the templated prompt leaves a thought open.
        self.modes: list[Mode] = []
        self.stops: frozenset[int] = frozenset()
        self.bytes: dict[int, bytes] | None = None
        self.opened: list[bool] = []

    def prepare(self, ref: Side, ckpt: Side) -> Inputs:
        """Each prompt's ids in each mode, made once and hashed (the candidate must agree), with its budget;
        the stop tokens, the tokens' bytes and which prompts open a thought, for `compare`."""
        skip_if_cannot_generate(ref, ckpt, "longform")
        tokenizer = (ckpt if ref.is_recorded else ref).tokenizer
        self.modes = modes_of(tokenizer)
        ids: list[list[int]] = []
        for mode in self.modes:
            ids += shared_prompt_ids(ref, ckpt, self.spec.prompts, **mode.template)
        self.opened = [_opens_thought(tokenizer.decode(i)) for i in ids]
        self.stops = stop_ids(ckpt.path)
        self.bytes = vocabulary_bytes(tokenizer)
        budgets = [self.spec.budget(p) for p in self.spec.prompts] * len(self.modes)
        prompts = [{"ids": i, "max_new_tokens": n} for i, n in zip(ids, budgets, strict=True)]
        return {PROMPTS: prompts, "prompts_sha256": ids_sha256(ids), "n_prompts": len(ids)}

    def needs(self) -> list[Need]:
        g = self.spec.generation
        # The expected answers and the language rule are compare-only: changing them never re-runs a model.
        identity = {
            "prompts": [
                p.model_dump(mode="json", include={"id", "prompt", "messages"}, exclude_none=True)
                | {"max_new_tokens": self.spec.budget(p)}
                for p in self.spec.prompts
            ],
            "modes": [m.name for m in self.modes],
        }
        observer = GreedyAnswers("longform-answers", "long answers", identity, g.top_k, 0, g.batch)
        return [Need(ANSWERS_LABEL, "ref", observer), Need(CKPT_ANSWERS_LABEL, "ckpt", observer)]

    def compare(self, observed: Mapping[str, Observation], artifacts: Path) -> TaskResult:
        pair = paired_answers(observed[ANSWERS_LABEL], observed[CKPT_ANSWERS_LABEL])
        n = len(self.spec.prompts)
        if len(pair) != n * len(self.modes):
            raise InputError(f"the sides answered {len(pair)} prompts, not {n * len(self.modes)}")
        values, null_reasons = batch_figures(pair)
        values["n_answers"] = len(pair)
        values["thinking_modes"] = (
            "both: enable_thinking false (figures unprefixed) and true (`thinking_…`)"
            if len(self.modes) > 1
            else "one: the chat template takes no `enable_thinking`"
        )
        sensitive = {
            "ref": batch_sensitive(pair.ref, pair.ref_other),
            "ckpt": batch_sensitive(pair.ckpt, pair.ckpt_other),
        }
        rows: list[dict[str, Any]] = []
        for m, mode in enumerate(self.modes):
            at = range(m * n, (m + 1) * n)
            ref, ckpt = [self.read(pair.ref, i) for i in at], [self.read(pair.ckpt, i) for i in at]
            found, reasons = mode_values(ref, ckpt, mode.thinks, len(self.modes) > 1)
            values.update({f"{mode.prefix}{k}": v for k, v in found.items()})
            null_reasons.update({f"{mode.prefix}{k}": v for k, v in reasons.items()})
            for j, i in enumerate(at):
                row = self.row(mode, self.spec.prompts[j], (pair.ref.texts[i], pair.ckpt.texts[i]))
                for side, r in (("ref", ref[j]), ("ckpt", ckpt[j])):
                    row.update(r.row(side, mode.thinks))
                    if sensitive[side] is not None and sensitive[side][i]:
                        row[f"{side}_batch_sensitive"] = True
                rows.append(row)
        # Every mode's figures under the spec's thresholds (the thinking mode's named `thinking_…`); a figure
        # left undefined (null, with its reason) is listed as not measured, never passed.
        measured = {k: v for k, v in values.items() if v is not None}
        checks, not_measured = self.spec.threshold_checks(measured, frozenset(measured))
        if len(self.modes) > 1:
            checks += subset_checks(self.spec, THINKING, measured)
            not_measured += [
                f"{THINKING}_{k}" for k in self.spec.thresholds if f"{THINKING}_{k}" in null_reasons
            ]
        return TaskResult.from_checks(
            values, checks, details=rows, null_reasons=null_reasons, not_measured=not_measured
        )

    def paired_differences(self, values: dict[str, Any]) -> list[Difference]:
        """Each mode's right answers, loops and answers in the prompt's language, the candidate against the
        reference on the same prompts (exact McNemar of the flips, two-sided): what the reports name where
        significant, whether or not a check covers them."""
        found = []
        for mode in self.modes:
            for what, said, lost, gained, p, covers in DIFFERENCES:
                c2w, w2c, p_value = (values.get(f"{mode.prefix}{k}") for k in (lost, gained, p))
                if not isinstance(p_value, float) or not isinstance(c2w, int) or not isinstance(w2c, int):
                    continue
                found.append(
                    Difference(
                        f"longform {what}{' (thinking mode)' if mode.thinks else ''}",
                        said.format(c2w=c2w, w2c=w2c),
                        "McNemar's exact test of the flips over prompts, two-sided",
                        p_value,
                        c2w > w2c,
                        tuple(f"{mode.prefix}{k}" for k in (lost, *covers)),
                    )
                )
        return found

    def read(self, answers_of: AnswerSet, i: int) -> Reading:
        """One side's answer to prompt `i` of the modes' prompts, read by `evalsuite.stats.answers`' rules."""
        mode = self.modes[i // len(self.spec.prompts)]
        prompt = self.spec.prompts[i % len(self.spec.prompts)]
        tokens, text, ends = answers_of.tokens[i], answers_of.texts[i], answers_of.char_ends[i]
        # `generate` stops at its budget or at a stop token, which it keeps.
        ended = len(tokens) < self.spec.budget(prompt) or (bool(tokens) and tokens[-1] in self.stops)
        stop = "eos" if ended else "budget"
        content = tokens[:-1] if stop == "eos" else tokens
        thought, unclosed, said = None, False, text
        if mode.thinks:
            cut = answers.thought_end(text, self.opened[i])
            # A thought never closed is all of the answer, counted in tokens: tokens with no text (a
            # special token again and again) are thought too.
            unclosed, said = answers.THOUGHT_CLOSE not in text and (self.opened[i] or cut > 0), text[cut:]
            thought = len(content) if unclosed else min(answers.tokens_through(ends, cut), len(content))
        data = None if self.bytes is None else b"".join(self.bytes.get(t, b"") for t in content)
        prose = answers.without_code(said)
        return Reading(
            length=len(tokens),
            stop=stop,
            loop=answers.loop_period(content[thought or 0 :]),
            fffd=answers.replacement_characters(text, data, stop == "eos"),
            invalid_utf8=None if data is None else answers.invalid_utf8_sequences(data, stop == "eos"),
            right=prompt.matches(said),
            in_language=answers.in_language(prose, prompt.language, self.spec.language.min_share),
            thought=thought,
            thought_loop=answers.loop_period(content[:thought]) if thought else None,
            thought_unclosed=unclosed,
        )

    def row(self, mode: Mode, prompt: LongPrompt, texts: tuple[str, str]) -> dict[str, Any]:
        """The start of one prompt's row in results.json's details (and report.md): both answers as
        decoded, the thought included."""
        row: dict[str, Any] = {"id": prompt.id}
        if len(self.modes) > 1:
            row["mode"] = mode.name
        row.update(category=prompt.category, language=prompt.language)
        return {**row, "ref_answer": texts[0], "ckpt_answer": texts[1]}


def _opens_thought(prompt_text: str) -> bool:
    """Whether a templated prompt leaves a thought open for the answer (its last `<think>` after its last
    `</think>`): the answer then starts inside it."""
    return prompt_text.rfind(answers.THOUGHT_OPEN) > prompt_text.rfind(answers.THOUGHT_CLOSE)
