"""What `longform` says of each side's long answers and of the two paired over prompts: one answer's reading
(`Reading`), one mode's figures (`mode_values`), what they mean (`DESCRIPTIONS`), and the paired tests the
reports name (`DIFFERENCES`); with what the reading needs of a tokenizer and a checkpoint's files (the bytes
of each token, the tokens decoding stops at).

Paired over prompts (each prompt one independent outcome): a yes/no outcome's flips from the reference to the
candidate with the exact McNemar p (`evalsuite.stats.metrics`); whether the candidate's losses of right final
answers are shown at 5%, undetermined where too few prompts are discordant for the test to show anything; the
length ratio as a paired log-ratio, exp of the mean over prompts of ln(candidate length / reference length),
with the two-sided 95% interval of t over prompts (`evalsuite.stats.claims.interval`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from evalsuite.stats import claims, metrics

THINKING = "thinking"  # the name of the thinking mode, and the prefix of its figures


@dataclass(frozen=True)
class Reading:
    """What one side's answer to one prompt is (`evalsuite.tasks.longform`'s module docstring)."""

    length: int  # tokens decoded, the stop token included
    stop: str  # "eos" or "budget"
    loop: int | None  # the period of the loop the answer (after any thought) ends in; None: no loop
    fffd: int  # U+FFFD in the text
    invalid_utf8: int | None  # ill-formed byte sequences; None where the tokenizer gives no bytes
    right: bool
    in_language: bool | None  # None: the answer's prose has no letters
    thought: int | None  # the thought's tokens (thinking mode), else None
    thought_loop: int | None
    thought_unclosed: bool

    def row(self, side: str, thinks: bool) -> dict[str, Any]:
        """The reading in a detail row, each cell named for its side."""
        row = {
            "loop": self.loop is not None,
            "loop_period": self.loop,
            "length": self.length,
            "stop": self.stop,
            "right": self.right,
            "in_language": self.in_language,
            "fffd": self.fffd,
            "invalid_utf8": self.invalid_utf8,
        }
        if thinks:
            row.update(
                thought_tokens=self.thought,
                thought_loop=self.thought_loop is not None,
                thought_unclosed=self.thought_unclosed,
            )
        return {f"{side}_{k}": v for k, v in row.items()}

    @property
    def invalid(self) -> bool:
        """The answer holds U+FFFD, or bytes that are not UTF-8."""
        return self.fffd > 0 or bool(self.invalid_utf8)


def stop_ids(checkpoint: Path) -> frozenset[int]:
    """The tokens greedy decoding stops at: the checkpoint's generation config's `eos_token_id`, as
    `generate` reads it (generation_config.json, else the model's config)."""
    from transformers import AutoConfig, GenerationConfig

    try:
        config = GenerationConfig.from_pretrained(checkpoint)
    except OSError:  # no generation_config.json
        config = GenerationConfig.from_model_config(AutoConfig.from_pretrained(checkpoint))
    eos = config.eos_token_id
    return frozenset([eos] if isinstance(eos, int) else list(eos or []))


def vocabulary_bytes(tokenizer: Any) -> dict[int, bytes] | None:
    """Each token's bytes as the tokenizer's decoder writes them before it makes text: a byte-level decoder's
    characters through GPT-2's byte-to-character map (`bytes_to_unicode`), a byte-fallback decoder's `<0xNN>`
    pieces as bytes (`▁` as a space); an added token as its text, a special one as nothing (the text skips
    it). None where the decoder is neither: the tokens' bytes are not known, only the text."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = json.loads(backend.decoder.__getstate__()) if backend is not None and backend.decoder else {}
    kinds = {decoder.get("type")} | {d.get("type") for d in decoder.get("decoders") or []}
    if not kinds & {"ByteLevel", "ByteFallback"}:
        return None
    special = set(tokenizer.all_special_ids)
    added = {i: t.content.encode() for i, t in tokenizer.added_tokens_decoder.items()}
    byte_of = {ch: b for b, ch in bytes_to_unicode().items()}
    table: dict[int, bytes] = {}
    for i, piece in enumerate(tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))):
        if i in special or piece is None:
            table[i] = b""
        elif i in added:
            table[i] = added[i]
        elif "ByteLevel" in kinds:
            if all(ch in byte_of for ch in piece):
                table[i] = bytes(byte_of[ch] for ch in piece)
        elif len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            table[i] = bytes([int(piece[3:5], 16)])
        else:
            table[i] = piece.replace("▁", " ").encode()
    return table


def counts(name: str, ref: Sequence[bool], ckpt: Sequence[bool]) -> dict[str, Any]:
    """Each side's count of prompts with an outcome (`NAME_ref`, `NAME_ckpt`) and the 95% Wilson interval of
    its share of the prompts (`NAME_ref_share_lower95`, `…_upper95`; each prompt one independent outcome)."""
    values: dict[str, Any] = {}
    for side, flags in (("ref", ref), ("ckpt", ckpt)):
        k = int(np.sum(flags))
        _, low, high = metrics.proportion_interval(k, len(flags))
        values[f"{name}_{side}"] = k
        values.update({f"{name}_{side}_share_lower95": low, f"{name}_{side}_share_upper95": high})
    return values


def paired_flags(name: str, ref: Sequence[bool], ckpt: Sequence[bool]) -> dict[str, Any]:
    """A yes/no outcome that is bad when true (a loop), per side and paired over prompts: each side's count
    (`counts`), the prompts where only the candidate has it (`ckpt_NAME_not_ref`) and only the reference, and
    the exact McNemar p of the two."""
    flips = metrics.flip_counts(np.logical_not(ref), np.logical_not(ckpt))
    return {
        **counts(name, ref, ckpt),
        f"ckpt_{name}_not_ref": flips.c2w,
        f"ref_{name}_not_ckpt": flips.w2c,
        f"{name.removesuffix('s')}_flips_p": metrics.mcnemar_exact_p(flips.c2w, flips.w2c),
    }


def right_answers(ref: Sequence[bool], ckpt: Sequence[bool]) -> dict[str, Any]:
    """Right final answers per side, those lost and gained, the exact McNemar p, and whether the test shows
    the candidate losing more than it gains at 5% (None where too few prompts are discordant to show it)."""
    flips = metrics.flip_counts(ref, ckpt)
    p = metrics.mcnemar_exact_p(flips.c2w, flips.w2c)
    decidable = flips.c2w + flips.w2c >= metrics.mcnemar_min_discordant(claims.ALPHA)
    return {
        **counts("right", ref, ckpt),
        "right_lost": flips.c2w,
        "right_gained": flips.w2c,
        "right_flips_p": p,
        "right_lost_shown": (flips.c2w > flips.w2c and p < claims.ALPHA) if decidable else None,
    }


def length_ratio(name: str, ref: Sequence[int], ckpt: Sequence[int]) -> dict[str, Any]:
    """The paired log-ratio of lengths (per prompt ln(candidate / reference), averaged) with its standard
    error, the ratio and its two-sided 95% interval (t over prompts; NaN ends below `claims.MIN_CLUSTERS`
    prompts), and how many prompts it is over."""
    if not ref:
        return {f"{name}_ratio": math.nan, f"{name}_ratio_n": 0}
    est = metrics.paired_log_ratio(np.log(np.asarray(ref, float)), np.log(np.asarray(ckpt, float)))
    low, high = claims.interval(est.value, est.stderr, est.n)
    return {
        f"{name}_log_ratio": est.value,
        f"{name}_log_ratio_stderr": est.stderr,
        f"{name}_ratio": math.exp(est.value),
        f"{name}_ratio_lower95": math.exp(low),
        f"{name}_ratio_upper95": math.exp(high),
        f"{name}_ratio_n": est.n,
    }


def mean_length(name: str, lengths: Sequence[int]) -> dict[str, float]:
    """A mean of lengths with its standard error (`NAME`, `NAME_stderr`)."""
    est = metrics.mean_with_stderr(lengths) if lengths else metrics.Estimate(math.nan, math.nan, 0)
    return {name: est.value, f"{name}_stderr": est.stderr}


def mode_values(
    ref: list[Reading], ckpt: list[Reading], thinks: bool, two_modes: bool
) -> tuple[dict[str, Any], dict[str, str]]:
    """One mode's figures over its prompts, each side's and paired (module docstring), and why any is null."""
    values: dict[str, Any] = {"n_prompts": len(ref)}
    values.update(
        paired_flags("loops", [r.loop is not None for r in ref], [r.loop is not None for r in ckpt])
    )
    budget = [r.stop == "budget" for r in ref], [r.stop == "budget" for r in ckpt]
    values.update(paired_flags("budget_stops", *budget))
    values.update(right_answers([r.right for r in ref], [r.right for r in ckpt]))
    judged = [(a.in_language, b.in_language) for a, b in zip(ref, ckpt, strict=True)]
    judged = [(a, b) for a, b in judged if a is not None and b is not None]
    off = paired_flags("off_language", [not a for a, _ in judged], [not b for _, b in judged])
    values["language_n"] = len(judged)
    values.update({k: v for k, v in off.items() if k.startswith("off_language_")})
    values.update(
        language_lost=off["ckpt_off_language_not_ref"],
        language_gained=off["ref_off_language_not_ckpt"],
        language_flips_p=values.pop("off_language_flips_p"),
    )
    values.update(paired_flags("invalid_text", [r.invalid for r in ref], [r.invalid for r in ckpt]))
    values.update(mean_length("length_mean_ref", [r.length for r in ref]))
    values.update(mean_length("length_mean_ckpt", [r.length for r in ckpt]))
    values.update(length_ratio("length", [r.length for r in ref], [r.length for r in ckpt]))
    reasons: dict[str, str] = {}
    if values["right_lost_shown"] is None:
        reasons["right_lost_shown"] = (
            f"undetermined: {values['right_lost'] + values['right_gained']} discordant prompt(s), and the "
            f"exact McNemar test cannot reach p < {claims.ALPHA} with fewer than "
            f"{metrics.mcnemar_min_discordant(claims.ALPHA)}"
        )
    if not thinks:
        values["ckpt_thought_loops_not_ref"] = None
        reasons["ckpt_thought_loops_not_ref"] = (
            f"asked with enable_thinking false, no thought was decoded (the thinking mode's is "
            f"`{THINKING}_ckpt_thought_loops_not_ref`)"
            if two_modes
            else "the chat template takes no `enable_thinking`: no thought was decoded"
        )
        return values, reasons
    loops = [r.thought_loop is not None for r in ref], [r.thought_loop is not None for r in ckpt]
    values.update(paired_flags("thought_loops", *loops))
    values.update(mean_length("thought_tokens_mean_ref", [r.thought or 0 for r in ref]))
    values.update(mean_length("thought_tokens_mean_ckpt", [r.thought or 0 for r in ckpt]))
    values["thought_unclosed_ref"] = sum(r.thought_unclosed for r in ref)
    values["thought_unclosed_ckpt"] = sum(r.thought_unclosed for r in ckpt)
    both = [(a.thought, b.thought) for a, b in zip(ref, ckpt, strict=True) if a.thought and b.thought]
    values.update(length_ratio("thought_length", [a for a, _ in both], [b for _, b in both]))
    return values, reasons


# The paired differences a run reports (`Longform.paired_differences`): what, the candidate's losses and gains
# in words, the metrics of its losses, gains and p, and those a check on which covers it.
DIFFERENCES = (
    (
        "right final answers",
        "{c2w} prompts right → wrong against {w2c} wrong → right",
        "right_lost",
        "right_gained",
        "right_flips_p",
        ("right_lost_shown",),
    ),
    (
        "loops",
        "{c2w} prompts looping on the candidate only against {w2c} on the reference only",
        "ckpt_loops_not_ref",
        "ref_loops_not_ckpt",
        "loop_flips_p",
        (),
    ),
    (
        "answers in the prompt's language",
        "{c2w} prompts in their language → not against {w2c} not → in it",
        "language_lost",
        "language_gained",
        "language_flips_p",
        (),
    ),
)

DESCRIPTIONS = {
    "n_prompts": "prompts answered by both sides (in each mode)",
    "loops_ref": "reference answers whose last 64 tokens repeat with a period of at most 32",
    "loops_ckpt": "candidate answers whose last 64 tokens repeat with a period of at most 32",
    "ckpt_loops_not_ref": "prompts whose candidate answer loops where the reference's does not",
    "loop_flips_p": "exact McNemar p of the loops gained against those lost, paired over prompts",
    "budget_stops_ref": "reference answers cut by the token budget (not ended by EOS)",
    "budget_stops_ckpt": "candidate answers cut by the token budget (not ended by EOS)",
    "right_ref": "reference final answers matching `expect` (and not `reject`)",
    "right_ckpt": "candidate final answers matching `expect` (and not `reject`)",
    "right_lost": "prompts the reference answers right and the candidate wrong",
    "right_gained": "prompts the candidate answers right and the reference wrong",
    "right_flips_p": "exact McNemar p of the right answers lost against those gained, over prompts",
    "right_lost_shown": "whether the candidate loses right answers more often than it gains them at p < 0.05 "
    "(exact McNemar); undetermined with too few discordant prompts for the test to show it",
    "language_n": "prompts whose answers have letters on both sides (the language rule's sample)",
    "off_language_ref": "reference answers whose prose is not in the prompt's language (by its letters)",
    "off_language_ckpt": "candidate answers whose prose is not in the prompt's language (by its letters)",
    "language_lost": "prompts the reference answers in their language and the candidate does not",
    "invalid_text_ref": "reference answers holding U+FFFD or an ill-formed UTF-8 byte sequence",
    "invalid_text_ckpt": "candidate answers holding U+FFFD or an ill-formed UTF-8 byte sequence",
    "length_mean_ref": "mean reference answer length in tokens (stop token included), with its stderr",
    "length_mean_ckpt": "mean candidate answer length in tokens (stop token included), with its stderr",
    "length_ratio": "exp of the mean over prompts of ln(candidate length / reference length), with its 95% "
    "interval (`length_ratio_lower95`, `_upper95`: t over prompts)",
    "ckpt_thought_loops_not_ref": "prompts whose candidate thought loops where the reference's does not",
    "thinking_modes": "the modes the prompts were asked in",
    "n_answers": "answers each side decoded: the prompts in every mode",
}
