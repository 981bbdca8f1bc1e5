"""The `lmeval` task's comparison of two sides' samples, document by document: accuracy of each side, the
paired difference and its standard error, recovery, flips and McNemar's exact test, and for multiple choice
the KL divergence between the two sides' distributions over the choices (`evalsuite.stats.metrics`)."""

from __future__ import annotations

from typing import Any

import numpy as np

from evalsuite.contract.observation import Observation
from evalsuite.errors import InputError
from evalsuite.stats import metrics


def compare_task(
    name: str, ref: Observation, ckpt: Observation
) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The paired statistics of one lm-eval task, `<task>.<metric>.<stat>`, and per binary metric the flips
    per document (−1 correct → wrong, +1 wrong → correct, 0 unchanged)."""
    entry, ref_entry = ckpt.meta["lm_eval_tasks"][name], ref.meta["lm_eval_tasks"][name]
    values: dict[str, Any] = {}
    flips: dict[str, np.ndarray] = {}
    multiple_choice = f"{name}/lls" in ref.arrays and f"{name}/lls" in ckpt.arrays
    choice = _choice_statistics(name, ref, ckpt) if multiple_choice else None
    for key in entry["per_document"]:
        if key not in ref_entry["per_document"]:
            continue
        a, b = ref.arrays[f"{name}/{key}"], ckpt.arrays[f"{name}/{key}"]
        p = f"{name}.{key}"
        est_ref, est_ckpt = metrics.mean_with_stderr(a), metrics.mean_with_stderr(b)
        delta = metrics.paired_difference(a, b)
        values.update(
            {
                f"{p}.n": int(a.size),
                f"{p}.ref": est_ref.value,
                f"{p}.ref_stderr": est_ref.stderr,
                f"{p}.ckpt": est_ckpt.value,
                f"{p}.ckpt_stderr": est_ckpt.stderr,
                f"{p}.delta": delta.value,
                f"{p}.delta_stderr": delta.stderr,
                f"{p}.recovery": metrics.recovery(est_ref.value, est_ckpt.value),
            }
        )
        metric = key.split(",")[0]
        binary = np.isin(a, (0.0, 1.0)).all() and np.isin(b, (0.0, 1.0)).all()
        if binary and entry["higher_is_better"].get(metric, True):
            f = metrics.flip_counts(a, b)
            values.update(
                {
                    f"{p}.flips_c2w": f.c2w,
                    f"{p}.flips_w2c": f.w2c,
                    f"{p}.flip_rate": f.rate,
                    f"{p}.mcnemar_p": metrics.mcnemar_exact_p(f.c2w, f.w2c),
                }
            )
            flips[key] = (b - a).astype(np.int64)
        if choice is not None:
            kld, changed = choice
            values[f"{p}.choice_kld_mean"] = kld.value
            values[f"{p}.choice_kld_mean_stderr"] = kld.stderr
            values[f"{p}.choice_change_rate"] = changed
    return values, flips


def _choice_statistics(name: str, ref: Observation, ckpt: Observation) -> tuple[metrics.Estimate, float]:
    """Mean KL divergence between the sides' softmax distributions over each document's choices, and the
    share of documents whose most likely choice changed, right or wrong."""
    counts = ref.arrays[f"{name}/n_choices"]
    if not np.array_equal(counts, ckpt.arrays[f"{name}/n_choices"]):
        raise InputError(f"the sides were given different choices in {name!r}")
    ends = np.cumsum(counts)
    a = np.split(ref.arrays[f"{name}/lls"], ends[:-1])
    b = np.split(ckpt.arrays[f"{name}/lls"], ends[:-1])
    kld = [metrics.choice_kl_divergence(x, y) for x, y in zip(a, b, strict=True)]
    changed = [int(np.argmax(x)) != int(np.argmax(y)) for x, y in zip(a, b, strict=True)]
    return metrics.mean_with_stderr(kld), float(np.mean(changed))


def side_answer(entry: dict[str, Any], i: int, key: str) -> str:
    """What a side answered: its most likely choice, or its generated text (under the metric's filter)."""
    if "choices" in entry:
        chosen = entry["chosen"][i]
        return entry["choices"][i][chosen.get(key.split(",")[0], chosen["acc"])].strip()
    filter_name = key.split(",")[1] if "," in key else "none"
    return entry["answers"].get(filter_name, [""] * (i + 1))[i].strip()


def plus_minus(values: dict[str, Any], name: str) -> str:
    value, err = values.get(name), values.get(f"{name}_stderr")
    if not isinstance(value, float):
        return "" if value is None else str(value)
    text = f"{value:.4g}"
    return f"{text} ± {err:.2g}" if isinstance(err, float) and np.isfinite(err) else text


def text_tail(text: str, chars: int) -> str:
    return text if len(text) <= chars else "…" + text[-chars:]


def text_head(text: str, chars: int) -> str:
    return text if len(text) <= chars else text[:chars] + "…"
