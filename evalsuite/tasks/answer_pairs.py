"""Both sides' decoded answers to the same prompts, paired: where they part, how each side ranked the two
tokens there, and which answers depend on the batch they were decoded in.

Every outcome is read off answers the sides decoded (`evalsuite.observers.greedy_answers`), never off forced
rows. The two sides are compared in one configuration: alone where both decoded alone (both loaded), else in
their batches (a streamed side decodes only those; the batches are the same prompts on both sides). The
configuration is part of the answer and is stated with it.

A divergence is judged at its own step, by the reference's own decoding there (both answers share every token
before it, so the reference's step is conditioned on the candidate's prefix too): a **near tie** when the
candidate's token is among the reference's top-k and the reference prefers its own token by less than
`near_tie` nats; a divergence **inside the top-k** when it prefers it by more; **outside the top-k** when the
reference did not rank the candidate's token among its first k at all (vLLM's rule for a real error).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from evalsuite.contract.observation import Observation
from evalsuite.observers.greedy_answers import ALONE, IN_BATCHES, AnswerSet, Configuration, answer_set
from evalsuite.stats import metrics

DIVERGENCE_MARK = "⟦"  # where the two answers part, inside each answer in report.md
NEAR_TIE, INSIDE_TOP, OUTSIDE_TOP = (
    "near tie",
    "inside the reference's top-k",
    "outside the reference's top-k",
)


@dataclass(frozen=True)
class PairedAnswers:
    """Both sides' answers in the configuration they are compared in (`compared`), with each side's
    configuration, and each side's answers in the other configuration where it decoded both."""

    ref: AnswerSet
    ckpt: AnswerSet
    compared: str | None  # ALONE or IN_BATCHES; None where the sides share no configuration
    ref_configuration: Configuration
    ckpt_configuration: Configuration
    ref_other: AnswerSet | None
    ckpt_other: AnswerSet | None

    def __len__(self) -> int:
        return len(self.ref)

    def step(self, i: int) -> int | None:
        """Prompt `i`'s first divergence: the first answer token the two sides decoded differently."""
        return metrics.first_divergence(self.ref.tokens[i], self.ckpt.tokens[i])

    def describe(self) -> str:
        """How the compared answers were decoded, in words."""
        if self.compared is None:
            return (
                f"reference {self.ref_configuration.describe()}; candidate "
                f"{self.ckpt_configuration.describe()} (the sides share no configuration)"
            )
        return self.ref_configuration.describe(self.compared)


def paired_answers(ref: Observation, ckpt: Observation) -> PairedAnswers:
    """Both sides' answers (observations of `GreedyAnswers`), paired in the configuration both decoded:
    alone where both did, else in batches; where they share none, each side's shown answers."""
    rc, cc = Configuration.of(ref), Configuration.of(ckpt)
    shared = [c for c in (ALONE, IN_BATCHES) if c in rc.decoded and c in cc.decoded]
    compared = shared[0] if shared else None

    def other(obs: Observation, config: Configuration, used: str) -> AnswerSet | None:
        rest = [c for c in config.decoded if c != used]
        return answer_set(obs, rest[0]) if rest else None

    ref_used, ckpt_used = compared or rc.shown, compared or cc.shown
    return PairedAnswers(
        ref=answer_set(ref, ref_used),
        ckpt=answer_set(ckpt, ckpt_used),
        compared=compared,
        ref_configuration=rc,
        ckpt_configuration=cc,
        ref_other=other(ref, rc, ref_used),
        ckpt_other=other(ckpt, cc, ckpt_used),
    )


def batch_sensitive(answers: AnswerSet, other: AnswerSet | None) -> list[bool] | None:
    """Per prompt, whether a side's answer alone and its answer in its batch differ (None: it decoded in one
    configuration only)."""
    if other is None:
        return None
    return [a != b for a, b in zip(answers.tokens, other.tokens, strict=True)]


def batch_cells(pair: PairedAnswers, i: int, judged: dict[str, Callable[[str], Any]]) -> dict[str, Any]:
    """What a row says where prompt `i`'s answer moves with the batch on a side (its answer alone and its
    answer in the batch differ): that side's `…_batch_sensitive`, its answer in the batch, and each judge of
    `judged` (a column's name → a judge of an answer's text) on it (`…_pass_in_batch`)."""
    row: dict[str, Any] = {}
    for side, answers, other in (("ref", pair.ref, pair.ref_other), ("ckpt", pair.ckpt, pair.ckpt_other)):
        if other is not None and answers.tokens[i] != other.tokens[i]:
            row[f"{side}_batch_sensitive"] = True
            row[f"{side}_answer_in_batch"] = other.texts[i]
            row.update({f"{side}_{name}_in_batch": judge(other.texts[i]) for name, judge in judged.items()})
    return row


def divergence_row(pair: PairedAnswers, i: int, top_k: int, near_tie: float) -> dict[str, Any]:
    """What a report says of prompt `i`'s first divergence (nothing where the answers are identical): the
    step, each side's token there, the reference's top-k at that step, each side's preference for its own
    token over the other's (nats; beyond the kept ids a lower bound), and the kind (module docstring)."""
    d = pair.step(i)
    if d is None:
        return {}
    ref_tokens, ckpt_tokens = pair.ref.tokens[i], pair.ckpt.tokens[i]
    ref_token = ref_tokens[d] if d < len(ref_tokens) else None
    ckpt_token = ckpt_tokens[d] if d < len(ckpt_tokens) else None
    row: dict[str, Any] = {"first_diff_token": d}
    if ref_token is None or ckpt_token is None:
        # One answer ended (its budget) where the other goes on: no token to weigh against the other.
        row.update(divergence=f"one answer ends at token {d}", ckpt_token_in_ref_top5=None)
        return row
    ref_gap, inside = _preference(pair.ref, i, d, ref_token, ckpt_token, top_k)
    ckpt_gap, _ = _preference(pair.ckpt, i, d, ckpt_token, ref_token, top_k)
    if not inside:
        kind = OUTSIDE_TOP
    elif isinstance(ref_gap, float) and ref_gap < near_tie:
        kind = NEAR_TIE
    else:
        kind = INSIDE_TOP
    row.update(
        ckpt_token_in_ref_top5=inside,
        ref_logp_gap=ref_gap,
        ckpt_logp_gap=ckpt_gap,
        near_tie=kind == NEAR_TIE,
        divergence=f"{kind.replace('top-k', f'top-{top_k}')} at token {d}",
        ref_top5=", ".join(
            f"{text!r} {float(lp):.3g}"
            for text, lp in zip(pair.ref.top_text[i][d], pair.ref.top_logp[i][d], strict=True)
        ),
        ref_token=repr(token_text(pair.ref, i, d)),
        ckpt_token=repr(token_text(pair.ckpt, i, d)),
    )
    return row


def _preference(
    answers: AnswerSet, i: int, step: int, own: int, other: int, top_k: int
) -> tuple[float | str, bool]:
    """How much a side's decoding preferred its own token to `other` at `step` (nats), and whether `other`
    is among its first `top_k`; beyond the kept ids only a lower bound is known (`">= x"`)."""
    ids = [int(t) for t in answers.top_ids[i][step]]
    logp = [float(v) for v in answers.top_logp[i][step]]
    mine = logp[ids.index(own)] if own in ids else logp[0]
    if other in ids:
        return mine - logp[ids.index(other)], other in ids[:top_k]
    return f">= {mine - logp[-1]:.4g}", False


def marked(text: str, char_ends: list[int], step: int | None) -> str:
    """An answer with the divergence mark where its token `step` begins."""
    if step is None:
        return text
    cut = char_ends[step - 1] if step > 0 and char_ends else 0
    return f"{text[:cut]}{DIVERGENCE_MARK}{text[cut:]}"


def token_text(answers: AnswerSet, i: int, step: int) -> str:
    """The text of the token prompt `i`'s answer chose at `step`."""
    ends = answers.char_ends[i]
    start = ends[step - 1] if step > 0 else 0
    return answers.texts[i][start : ends[step]]
