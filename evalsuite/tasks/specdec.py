"""Speculative decoding: does drafting leave each side's greedy answers as they are, and how many drafted
tokens does each side accept?

The prompts (`tasks/specdec.toml`) cover the eight workloads of exllamav3's `eval/spec_decode.py`: trivial
repetition, agentic code, agentic shell, creative writing with and without reasoning, translation with and
without reasoning, and coding. Each side decodes every prompt greedily twice, alone each time: plainly
(`evalsuite.observers.greedy_answers`, the answers `smoke` decodes) and with drafting
(`evalsuite.observers.drafted_answers`: Transformers' assisted generation, drafting by prompt lookup, or by
the checkpoint `--draft` names). Drafting is decided per side alone: each side verifies its own drafts with
its own model, batch 1.

- **Lossless** (`ref_lossless`, `ckpt_lossless`): every drafted answer equals the side's plain answer token
  for token. Greedy drafting is lossless in exact arithmetic; a verification forward of several tokens is
  not the arithmetic of one token at a time, and a side whose answers drafting changes fails by default.
  Where it changed one, the two decodings are paired as `smoke` pairs two sides (`evalsuite.tasks.
  answer_pairs`): the token they part at and how the plain decoding ranked the drafted token there.
- **Acceptance** (`…_accept_…`): per prompt the mean accepted length, new tokens / verification rounds (the
  target's forwards: `evalsuite.backends.drafting`), each round's bonus token included; per category and
  overall its mean over prompts with a 95% t interval (each prompt one unit), for each side, and the
  candidate's minus the reference's paired over prompts, called higher or lower only where its interval
  excludes 0. The rounds are each category's totals.
- **Tokens per second** only where a GPU runs the side: a wall time on a CPU shared with other work says more
  about the machine than about drafting.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar, Literal, get_args

import numpy as np
from pydantic import field_validator

from evalsuite.backends.drafting import Drafting
from evalsuite.contract.observation import Observation
from evalsuite.contract.spec import StrictModel, TaskSpec
from evalsuite.errors import InputError
from evalsuite.files.checkpoint import Checkpoint
from evalsuite.observers.drafted_answers import DRAFTED, DraftedAnswers
from evalsuite.observers.greedy_answers import ANSWERS_LABEL, PROMPTS, GreedyAnswers
from evalsuite.protocol.side import Side
from evalsuite.protocol.task import Inputs, Need, RunContext, TaskResult, TaskSkipped, task
from evalsuite.stats import claims, metrics
from evalsuite.tasks.answer_pairs import PairedAnswers, divergence_row, marked, paired_answers
from evalsuite.tasks.smoke import (
    CKPT_ANSWERS_LABEL,
    ChatPrompt,
    ids_sha256,
    prompt_ids,
    refuse_repeated_ids,
    shared_prompt_ids,
)

# exllamav3's eval/spec_decode.py's workloads, in its order.
Category = Literal[
    "trivial_repetition",
    "agentic_code",
    "agentic_shell",
    "creative",
    "creative_reasoning",
    "translation",
    "translation_reasoning",
    "coding",
]
CATEGORIES: tuple[str, ...] = get_args(Category)
SIDES = ("ref", "ckpt")
DRAFTED_LABEL, CKPT_DRAFTED_LABEL = "drafted", "ckpt-drafted"
TIMED_ONLY_ON_GPU = (
    "tokens per second are measured only where a GPU runs the side: a wall time on a CPU shared with other "
    "work says more about the machine than about drafting"
)


class Prompt(ChatPrompt):
    category: Category
    # The chat template's `enable_thinking` (exllamav3's reasoning workloads); a template without the switch
    # ignores it, so a reasoning prompt also asks for the reasoning in its words.
    thinking: bool = False

    def template_options(self) -> dict[str, Any]:
        return {"enable_thinking": self.thinking}


class DraftingOptions(StrictModel):
    # Prompt lookup (no --draft): drafted tokens a round, and the longest n-gram matched in the prompt and
    # answer so far (Transformers' prompt_lookup_num_tokens, max_matching_ngram_size).
    lookup_tokens: int = 10
    max_ngram: int = 2
    # A draft checkpoint (--draft): drafted tokens a round, on a constant schedule with no confidence cut-off.
    draft_tokens: int = 5

    @field_validator("lookup_tokens", "max_ngram", "draft_tokens")
    @classmethod
    def _positive(cls, value: int) -> int:
        if value < 1:
            raise ValueError("must be at least 1")
        return value


class GenerationOptions(StrictModel):
    top_k: int = 5  # log-probs kept per step: how a changed answer parted from the plain one
    near_tie: float = 1.0  # nats: a change where the plain decoding preferred its token by less is a near tie


class SpecdecSpec(TaskSpec):
    drafting: DraftingOptions = DraftingOptions()
    generation: GenerationOptions = GenerationOptions()
    prompts: list[Prompt]

    def model_post_init(self, _: Any) -> None:
        refuse_repeated_ids(self.prompts)


@task("specdec")
class SpeculativeDecoding:
    """Greedy decoding with drafting on each side: lossless against its own plain decoding, and how much of
    each side's drafts it accepts (module docstring)."""

    spec_model: ClassVar[type[TaskSpec]] = SpecdecSpec
    metric_names: ClassVar[tuple[str, ...]] = ("n_prompts*", "ref_*", "ckpt_*", "accept_diff_*")
    metric_descriptions: ClassVar[dict[str, str]] = {
        "n_prompts": "prompts each side decoded greedily alone, plainly and with drafting",
        "drafting": "what drafted: Transformers' prompt lookup, or a draft checkpoint",
        "ref_lossless": "every reference answer drafted equals its plain answer token for token",
        "ckpt_lossless": "every candidate answer drafted equals its plain answer token for token",
        "ref_drafting_changed": "prompts whose reference answer drafting changed",
        "ckpt_drafting_changed": "prompts whose candidate answer drafting changed",
        "ref_drafting_changed_beyond_near_tie": "prompts whose reference answer drafting changed at a step "
        "where the plain decoding preferred its own token by at least `near_tie` (the check)",
        "ckpt_drafting_changed_beyond_near_tie": "prompts whose candidate answer drafting changed at a step "
        "where the plain decoding preferred its own token by at least `near_tie` (the check)",
        "ref_accept_mean": "the reference's mean accepted length (new tokens per verification round, the "
        "bonus token included), its mean over prompts, with a 95% t interval",
        "ckpt_accept_mean": "the candidate's mean accepted length, its mean over prompts, with a 95% t "
        "interval",
        "accept_diff_mean": "the candidate's mean accepted length minus the reference's, paired over "
        "prompts, with a 95% t interval",
        "accept_diff_mean_direction": "higher or lower where the paired interval excludes 0; same where "
        "every prompt's is 0; else undetermined",
        "ref_rounds": "the reference's verification rounds (its model's forwards while drafting), all "
        "prompts",
        "ckpt_rounds": "the candidate's verification rounds, all prompts",
        "ref_speedup": "the reference's plain decoding time over its drafted one, mean over prompts (GPU "
        "only)",
        "ckpt_speedup": "the candidate's plain decoding time over its drafted one, mean over prompts (GPU "
        "only)",
    }

    def __init__(self, spec: SpecdecSpec, context: RunContext) -> None:
        self.spec = spec
        self.context = context
        # What drafts, as the drafted observations' identity keeps it (a draft by its content's digest).
        self.drafting: dict[str, Any] = {}

    def prepare(self, ref: Side, ckpt: Side) -> Inputs:
        """The prompts' ids, made once and agreed by both sides (`smoke.shared_prompt_ids`); skipped where a
        side cannot draft; a draft checkpoint checked against the sides' tokenizer."""
        for side in (ref, ckpt):
            why = cannot_draft(side)
            if why is not None:
                raise TaskSkipped(f"specdec drafts on each side, and on the {side.role} side {why}")
        ids = shared_prompt_ids(ref, ckpt, self.spec.prompts)
        d = self.spec.drafting
        draft_path = self.context.draft_path
        if draft_path is None:
            self.drafting = {"kind": "prompt lookup", "tokens": d.lookup_tokens, "max_ngram": d.max_ngram}
        else:
            draft = checked_draft(draft_path, ckpt if ref.is_recorded else ref, self.spec.prompts, ids)
            digest = draft.content_sha256(self.context.digests)
            self.drafting = {"kind": "draft model", "tokens": d.draft_tokens, "content_sha256": digest}
        prompts = [
            {"ids": i, "max_new_tokens": p.max_new_tokens}
            for i, p in zip(ids, self.spec.prompts, strict=True)
        ]
        return {PROMPTS: prompts, "prompts_sha256": ids_sha256(ids), "n_prompts": len(ids)}

    def needs(self) -> list[Need]:
        g, d = self.spec.generation, self.spec.drafting
        identity = {
            "prompts": [
                p.model_dump(
                    mode="json",
                    include={"id", "prompt", "messages", "max_new_tokens", "thinking"},
                    exclude_none=True,
                )
                for p in self.spec.prompts
            ]
        }
        plain = GreedyAnswers("specdec-answers", "specdec prompts", identity, g.top_k, 0, 1)
        settings = Drafting(d.lookup_tokens, d.max_ngram, None, d.draft_tokens)
        drafted = DraftedAnswers(
            "specdec-drafted",
            "specdec prompts",
            identity,
            g.top_k,
            self.drafting,
            settings,
            self.context.draft_path,
        )
        return [
            Need(ANSWERS_LABEL, "ref", plain),
            Need(DRAFTED_LABEL, "ref", drafted),
            Need(CKPT_ANSWERS_LABEL, "ckpt", plain),
            Need(CKPT_DRAFTED_LABEL, "ckpt", drafted),
        ]

    def compare(self, observed: Mapping[str, Observation], artifacts: Path) -> TaskResult:
        prompts, g = self.spec.prompts, self.spec.generation
        pairs = {
            "ref": paired_answers(observed[ANSWERS_LABEL], observed[DRAFTED_LABEL]),
            "ckpt": paired_answers(observed[CKPT_ANSWERS_LABEL], observed[CKPT_DRAFTED_LABEL]),
        }
        drafted = {"ref": observed[DRAFTED_LABEL], "ckpt": observed[CKPT_DRAFTED_LABEL]}
        for side, pair in pairs.items():
            if len(pair) != len(prompts) or len(pair.ckpt) != len(prompts):
                raise InputError(f"the {side} side answered {len(pair)} prompts, not {len(prompts)}")
        # Per side and prompt, where drafting changed the answer (`divergence_row` of plain against drafted,
        # empty where it did not), and the mean accepted length.
        changes = {
            side: [divergence_row(pairs[side], i, g.top_k, g.near_tie) for i in range(len(prompts))]
            for side in SIDES
        }
        accepted = {
            side: metrics.tokens_per_round(
                [len(t) for t in pairs[side].ckpt.tokens], drafted[side].arrays["rounds"]
            )
            for side in SIDES
        }
        values: dict[str, Any] = {
            "n_prompts": len(prompts),
            "drafting": describe(drafted["ckpt"].meta.get("drafting") or self.drafting),
        }
        null_reasons: dict[str, str] = {}
        for side in SIDES:
            values[f"{side}_lossless"] = not any(changes[side])
            values[f"{side}_drafting_changed"] = sum(bool(found) for found in changes[side])
            values[f"{side}_drafting_near_ties"] = sum(bool(found.get("near_tie")) for found in changes[side])
            values[f"{side}_drafting_changed_beyond_near_tie"] = (
                values[f"{side}_drafting_changed"] - values[f"{side}_drafting_near_ties"]
            )
            values.update(interval_values(f"{side}_accept_mean", claims.mean_interval(accepted[side])))
            values[f"{side}_rounds"] = int(drafted[side].arrays["rounds"].sum())
            values[f"{side}_drafted_tokens"] = int(drafted[side].arrays[DRAFTED].sum())
            values[f"{side}_new_tokens"] = sum(len(t) for t in pairs[side].ckpt.tokens)
            timing, reasons = speed_values(side, pairs[side], drafted[side])
            values.update(timing)
            null_reasons.update(reasons)
        difference = claims.mean_interval(accepted["ckpt"] - accepted["ref"])
        values.update(interval_values("accept_diff_mean", difference))
        values["accept_diff_mean_direction"] = claims.direction(difference)
        rows, descriptions = self.by_category(values, accepted, drafted)
        for i, prompt in enumerate(prompts):
            rows.append(self.prompt_row(i, prompt, pairs, drafted, accepted, changes))
        null_reasons.update(too_few_prompts(values))
        checks, _ = self.spec.threshold_checks(values)
        return TaskResult.from_checks(
            values, checks, details=rows, null_reasons=null_reasons, descriptions=descriptions
        )

    def by_category(
        self, values: dict[str, Any], accepted: dict[str, np.ndarray], drafted: dict[str, Observation]
    ) -> tuple[list[dict[str, Any]], dict[str, str]]:
        """Each category's figures into `values` (each side's mean accepted length with its interval and its
        rounds, the paired difference and what it lets the report say), with a row and a description each."""
        categories = np.asarray([p.category for p in self.spec.prompts])
        rows: list[dict[str, Any]] = []
        descriptions: dict[str, str] = {}
        # A workload's direction is one claim of as many as the run has workloads: said only where the
        # Bonferroni interval over all of them excludes 0 (the 95% interval is still the one reported).
        family = len(set(categories.tolist()) & set(CATEGORIES))
        level = 1 - (1 - claims.LEVEL) / max(1, family)
        for category in CATEGORIES:
            chosen = categories == category
            if not chosen.any():
                continue
            values[f"n_prompts_{category}"] = int(chosen.sum())
            for side in SIDES:
                found = claims.mean_interval(accepted[side][chosen])
                values.update(interval_values(f"{side}_accept_{category}", found))
                values[f"{side}_rounds_{category}"] = int(drafted[side].arrays["rounds"][chosen].sum())
            diff = claims.mean_interval(accepted["ckpt"][chosen] - accepted["ref"][chosen])
            values.update(interval_values(f"accept_diff_{category}", diff))
            differences = accepted["ckpt"][chosen] - accepted["ref"][chosen]
            values[f"accept_diff_{category}_direction"] = claims.direction(
                claims.mean_interval(differences, level)
            )
            descriptions[f"accept_diff_{category}"] = (
                f"{category.replace('_', ' ')}: the candidate's mean accepted length minus the reference's, "
                f"paired over the category's prompts ({int(chosen.sum())}); its direction said only where "
                f"the Bonferroni interval over the {family} workloads excludes 0"
            )
            rows.append(category_row(category, values))
        return rows, descriptions

    def prompt_row(
        self,
        i: int,
        prompt: Prompt,
        pairs: dict[str, PairedAnswers],
        drafted: dict[str, Observation],
        accepted: dict[str, np.ndarray],
        changes: dict[str, list[dict[str, Any]]],
    ) -> dict[str, Any]:
        """One prompt: each side's rounds, new tokens and mean accepted length, and where drafting changed a
        side's answer, both of its answers, the token they part at and how the plain decoding ranked the two
        tokens there."""
        row: dict[str, Any] = {"table": "Prompts", "id": prompt.id, "category": prompt.category}
        for side in SIDES:
            pair, found = pairs[side], changes[side][i]
            row[f"{side}_rounds"] = int(drafted[side].arrays["rounds"][i])
            row[f"{side}_tokens"] = len(pair.ckpt.tokens[i])
            row[f"{side}_accept"] = float(accepted[side][i])
            row[f"{side}_lossless"] = not found
            if found:
                step = found["first_diff_token"]
                row[f"{side}_plain_answer"] = marked(pair.ref.texts[i], pair.ref.char_ends[i], step)
                row[f"{side}_drafted_answer"] = marked(pair.ckpt.texts[i], pair.ckpt.char_ends[i], step)
                row[f"{side}_change"] = change_words(found, self.spec.generation.top_k)
                row[f"{side}_plain_gap"] = found.get("ref_logp_gap")
                row[f"{side}_change_near_tie"] = bool(found.get("near_tie"))
        row["accept_diff"] = float(accepted["ckpt"][i] - accepted["ref"][i])
        return row


def cannot_draft(side: Side) -> str | None:
    """Why a side cannot decode with Transformers' assisted generation (None: it can), from its files and
    options: a recording replays what was drafted; a format's own runtime (llama.cpp, exllamav3 on CUDA) runs
    no Transformers model; a stateful model is refused by Transformers itself."""
    if side.checkpoint is None:
        return None
    if side.options.backend == "llamacpp":
        return "llama.cpp runs the model, not Transformers"
    if side.options.backend == "exl3":
        from evalsuite.backends.exl3 import exllamav3_path

        if exllamav3_path(side.options):
            return "exllamav3 runs the model, not Transformers"
    from evalsuite.backends.hf import assisted_generation_refusal

    return assisted_generation_refusal(side.checkpoint, side.options)


def checked_draft(path: Path, side: Side, prompts: list[Prompt], ids: list[list[int]]) -> Checkpoint:
    """The draft checkpoint at `path`, refused (InputError) unless it tokenizes as the sides do: the same
    vocabulary and the same ids for every prompt (Transformers' assisted generation feeds the draft the
    target's token ids), and unless Transformers can draft with it."""
    from evalsuite.backends.hf import assisted_generation_refusal

    draft = Side("ckpt", side.options.with_backend("hf"), checkpoint=Checkpoint.open(path))
    if draft.checkpoint.tokenizer_sha256 != side.checkpoint.tokenizer_sha256:
        if draft.tokenizer.get_vocab() != side.tokenizer.get_vocab():
            raise InputError(
                "the draft's tokenizer differs from the checkpoints': its vocabulary differs", path
            )
        for prompt, made in zip(prompts, ids, strict=True):
            if prompt_ids(draft, prompt) != made:
                raise InputError(
                    f"the draft's tokenizer differs from the checkpoints': prompt {prompt.id!r} tokenizes "
                    "otherwise",
                    path,
                )
    why = assisted_generation_refusal(draft.checkpoint, draft.options)
    if why is not None:
        raise InputError(f"cannot draft: {why}", path)
    return draft.checkpoint


def describe(drafting: dict[str, Any]) -> str:
    """What drafted, in words."""
    if drafting.get("kind") == "draft model":
        digest = str(drafting.get("content_sha256", ""))[:12]
        return f"a draft checkpoint (content {digest}), {drafting.get('tokens')} tokens a round"
    return (
        f"Transformers' prompt lookup, up to {drafting.get('tokens')} tokens a round after an n-gram of "
        f"up to {drafting.get('max_ngram')} tokens"
    )


def too_few_prompts(values: dict[str, Any]) -> dict[str, str]:
    """Why an interval's bounds are null: too few prompts to claim anything from (`claims.MIN_CLUSTERS`)."""
    reasons = {}
    for name, value in values.items():
        if name.endswith(("_lower95", "_upper95")) and isinstance(value, float) and not np.isfinite(value):
            n = values.get(f"{name.rsplit('_', 1)[0]}_n")
            reasons[name] = (
                f"{n} prompt(s): a 95% interval needs at least {claims.MIN_CLUSTERS} (undetermined)"
            )
    return reasons


def interval_values(name: str, interval: claims.Interval) -> dict[str, Any]:
    """A mean over prompts as results.json keeps it: the value, its 95% bounds and its sample size."""
    return {
        name: interval.value,
        f"{name}_lower95": interval.lower,
        f"{name}_upper95": interval.upper,
        f"{name}_n": interval.n,
    }


def speed_values(
    side: str, pair: PairedAnswers, drafted: Observation
) -> tuple[dict[str, Any], dict[str, str]]:
    """A side's tokens per second drafted and plain and its speedup (plain time over drafted time), each a
    mean over prompts with its interval, where the side was timed (on a GPU); else None with the reason."""
    seconds, plain = drafted.arrays["seconds"], drafted.arrays["plain_seconds"]
    names = (f"{side}_tokens_per_s", f"{side}_tokens_per_s_plain", f"{side}_speedup")
    if not np.isfinite(seconds).all() or not np.isfinite(plain).all():
        return dict.fromkeys(names), dict.fromkeys(names, TIMED_ONLY_ON_GPU)
    values: dict[str, Any] = {}
    drafted_tokens = np.asarray([len(t) for t in pair.ckpt.tokens], dtype=np.float64)
    plain_tokens = np.asarray([len(t) for t in pair.ref.tokens], dtype=np.float64)
    for name, figures in zip(
        names, (drafted_tokens / seconds, plain_tokens / plain, plain / seconds), strict=True
    ):
        values.update(interval_values(name, claims.mean_interval(figures)))
    return values, {}


def change_words(found: dict[str, Any], top_k: int) -> str:
    """How drafting changed an answer, in words, from `answer_pairs.divergence_row` of (plain, drafted)."""
    step = found.get("first_diff_token")
    inside = found.get("ckpt_token_in_ref_top5")
    if inside is None:
        return f"one answer ends at token {step}"
    if not inside:
        return f"at token {step}, outside the plain decoding's top-{top_k}"
    kind = "a near tie" if found.get("near_tie") else f"inside the plain decoding's top-{top_k}"
    return f"at token {step}, {kind}"


def category_row(category: str, values: dict[str, Any]) -> dict[str, Any]:
    """One category's figures as report.md shows them: each side's mean accepted length with its interval
    and rounds, and the paired difference with what it lets the report say."""

    def shown(name: str) -> str:
        low, high = values[f"{name}_lower95"], values[f"{name}_upper95"]
        bounds = f"[{low:.3g}, {high:.3g}]" if np.isfinite(low) else "(too few prompts for an interval)"
        return f"{values[name]:.3g} {bounds}"

    return {
        "table": "Categories",
        "category": category,
        "prompts": values[f"n_prompts_{category}"],
        "ref_accept": shown(f"ref_accept_{category}"),
        "ckpt_accept": shown(f"ckpt_accept_{category}"),
        "ref_rounds": values[f"ref_rounds_{category}"],
        "ckpt_rounds": values[f"ckpt_rounds_{category}"],
        "ckpt − ref": shown(f"accept_diff_{category}"),
        "candidate": values[f"accept_diff_{category}_direction"],
    }
