"""The `tools` task's figures from its rows: for each outcome of an answer (it holds a JSON object, it is
valid under the case's schema, it is the expected call or object), each side's share of the cases with its
Wilson interval, the flips between the sides with McNemar's exact p, and the drop of the share with
Newcombe's paired interval; what each figure means, with its interval, for report.md; the paired tests the
reports name where significant. Each case is one independent outcome: every interval is over cases."""

from __future__ import annotations

from typing import Any

from evalsuite.protocol.task import Difference
from evalsuite.stats import metrics

# Each outcome: its metrics' prefix, the name of its per-side count (`ref_parsed`), what it says of an answer.
OUTCOMES = {
    "parse": ("parsed", "holds a JSON object"),
    "schema_valid": ("schema_valid", "is valid under the case's schema"),
    "right_call": ("right_call", "is the expected call or object"),
}
SIDES = (("ref", "reference's"), ("ckpt", "candidate's"))


def outcomes(rows: list[dict[str, Any]], side: str, outcome: str) -> list[bool]:
    """Per case, whether a side's answer has the outcome (a row's `…_parsed` is the object found, or None)."""
    if outcome == "parse":
        return [row[f"{side}_parsed"] is not None for row in rows]
    return [bool(row[f"{side}_{outcome}"]) for row in rows]


def outcome_figures(outcome: str, ref: list[bool], ckpt: list[bool]) -> dict[str, Any]:
    """One outcome, per case on each side: each side's count and share with its 95% Wilson interval; the
    flips between the sides with McNemar's exact p; the drop of the share (reference − candidate) with
    Newcombe's paired 95% interval."""
    flips = metrics.flip_counts(ref, ckpt)
    both = sum(a and b for a, b in zip(ref, ckpt, strict=True))
    neither = flips.n - both - flips.c2w - flips.w2c
    count = OUTCOMES[outcome][0]
    values: dict[str, Any] = {}
    for side, found in (("ref", ref), ("ckpt", ckpt)):
        share, low, high = metrics.proportion_interval(sum(found), len(found))
        values[f"{side}_{count}"] = sum(found)
        values.update({f"{outcome}_rate_{side}": share, f"{outcome}_rate_{side}_lower95": low})
        values[f"{outcome}_rate_{side}_upper95"] = high
    drop, low, high = metrics.paired_proportion_difference(both, flips.c2w, flips.w2c, neither)
    values.update({f"{outcome}_rate_drop": drop, f"{outcome}_rate_drop_lower95": low})
    values[f"{outcome}_rate_drop_upper95"] = high
    values.update({f"{outcome}_lost": flips.c2w, f"{outcome}_gained": flips.w2c})
    values[f"{outcome}_flip_p"] = metrics.mcnemar_exact_p(flips.c2w, flips.w2c)
    return values


def _interval(values: dict[str, Any], name: str) -> str:
    return f"[{values[f'{name}_lower95']:.3g}, {values[f'{name}_upper95']:.3g}]"


def outcome_descriptions(values: dict[str, Any]) -> dict[str, str]:
    """What each outcome's main figures mean on this run, with their sample and interval (report.md)."""
    n, out = values["n_cases"], {}
    for outcome, (_, words) in OUTCOMES.items():
        for side, who in SIDES:
            name = f"{outcome}_rate_{side}"
            out[name] = f"share of the {n} cases whose {who} answer {words}; 95% Wilson interval over cases "
            out[name] += _interval(values, name)
        name = f"{outcome}_rate_drop"
        out[name] = (
            f"the reference's share of cases whose answer {words} minus the candidate's, paired over the {n} "
            f"cases; 95% Newcombe interval {_interval(values, name)}"
        )
        out[f"{outcome}_lost"] = (
            f"cases whose reference answer {words} and whose candidate answer does not "
            f"(`{outcome}_gained`: {values[f'{outcome}_gained']} the other way; McNemar's exact p of the two "
            f"{values[f'{outcome}_flip_p']:.3g})"
        )
    return out


def outcome_differences(values: dict[str, Any]) -> list[Difference]:
    """Each outcome, the candidate against the reference on the same cases: McNemar's exact test of the
    flips, two-sided. What reports name where significant, whether or not a check covers it."""
    found = []
    for outcome, (_, words) in OUTCOMES.items():
        lost, gained, p = (values.get(f"{outcome}_{k}") for k in ("lost", "gained", "flip_p"))
        if not isinstance(lost, int) or not isinstance(gained, int) or not isinstance(p, float):
            continue
        ref, ckpt = (Difference.figure(values.get(f"{outcome}_rate_{side}")) for side in ("ref", "ckpt"))
        said = (
            f"{ref} → {ckpt} of the cases whose answer {words}: {lost} on the reference only, {gained} on "
            "the candidate only"
        )
        test = "McNemar's exact test of the flips, two-sided"
        covers = tuple(f"{outcome}_{s}" for s in ("rate_drop", "rate_ckpt", "lost", "gained", "flip_p"))
        found.append(Difference(f"`tools` {outcome.replace('_', ' ')}", said, test, p, lost > gained, covers))
    return found
