"""What the serving tasks (`longform`, `tools`, `specdec`) take at the real shape, for bench/real_shape.py.

The 70 GB model fits neither a 24 GB GPU nor this 24 GB machine whole, so each side runs streamed, and a
streamed side decodes every prompt in its spec's batches (`[generation] batch`, ordered by budget: the same
batches on both sides), every forward reading each decoder layer again (of a MoE layer, the experts its
tokens route to). The forwards are counted from the shipped specs, as `decoding_forwards` counts smoke's:

- `longform`: per batch its largest budget (the random wide pair never stops early; a real model's answers
  that end sooner make fewer), once per mode: twice where the chat template takes `enable_thinking`;
- `tools`: per batch of cases its largest budget;
- `specdec`: each prompt alone, plainly (its budget) and drafted (one verification round per accepted run:
  at most its budget again). Transformers refuses assisted generation for a stateful model, and the seed's
  Gated DeltaNet layers are one: on it the task is skipped with that reason, before anything decodes.

Each forward costs what the measured smoke decoding's forward costs at 40 layers (`decoding_forward` of the
observed validation: a batch of 32 prompts, up to 128 new tokens), by side: for `longform`, whose answers run
to 512 tokens, the ten attention layers attend over more tokens than that measurement did; a forward of one
prompt (`specdec`) routes to fewer experts than a batch's. Both are said beside the figures: the time is the
measured cost × the counted forwards, and the bytes read the measured bytes per forward × the forwards.

On a 24 GB GPU the side streams the same way, each layer materialised on the GPU: the forwards and the bytes
they read are the same, what stays resident is one decoder layer, the embeddings and head and the decoding's
caches at the task's batch and length (`resident_bytes`); its time was not measured: no GPU ran the wide pair.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from evalsuite.contract.spec import default_spec_path, load_spec
from evalsuite.observers.greedy_answers import batches

SERVING_TASKS = ("longform", "tools", "specdec")
GPU_MEMORY_BYTES = 24e9  # the GPU a publisher of the seed's pack is most likely to hold


def _batched(budgets: list[int], batch: int) -> int:
    """Forwards of a streamed side decoding prompts of these budgets in batches of `batch`, by budget: per
    batch its largest budget."""
    prompts = [{"ids": [], "max_new_tokens": n} for n in budgets]
    return sum(max(budgets[i] for i in members) for members in batches(prompts, batch, by_budget=True))


def serving_forwards(thinking: bool) -> dict[str, dict[str, Any]]:
    """Per serving task, under its shipped spec, the most forwards a streamed side's decoding takes (module
    docstring), its batch, its longest answer and how many prompts; `thinking`: whether the chat template
    takes `enable_thinking` (longform then decodes in both modes)."""
    from evalsuite.tasks.longform import LongformSpec
    from evalsuite.tasks.specdec import SpecdecSpec
    from evalsuite.tasks.tools import ToolsSpec

    longform = load_spec(LongformSpec, default_spec_path("longform"))
    tools = load_spec(ToolsSpec, default_spec_path("tools"))
    specdec = load_spec(SpecdecSpec, default_spec_path("specdec"))
    modes = 2 if thinking else 1
    long_budgets = [longform.budget(p) for p in longform.prompts]
    tool_budgets = [c.max_new_tokens for c in tools.cases]
    spec_budgets = [p.max_new_tokens for p in specdec.prompts]
    return {
        "longform": {
            "prompts": len(long_budgets),
            "modes": modes,
            "batch": longform.generation.batch,
            "longest": max(long_budgets),
            "forwards": modes * _batched(long_budgets, longform.generation.batch),
        },
        "tools": {
            "prompts": len(tool_budgets),
            "modes": 1,
            "batch": tools.generation.batch,
            "longest": max(tool_budgets),
            "forwards": _batched(tool_budgets, tools.generation.batch),
        },
        "specdec": {
            "prompts": len(spec_budgets),
            "modes": 1,
            "batch": 1,
            "longest": max(spec_budgets),
            "forwards": 2 * sum(spec_budgets),
        },
    }


def resident_bytes(doc: dict[str, Any], batch: int, tokens: int, cache_growth: Any) -> float:
    """What a streamed side holds at 40 layers while it decodes a batch of `batch` prompts of up to `tokens`
    tokens: its largest decoder layer twice (read, and fused as run), the parts outside the layers (the
    reference's BF16 embeddings and head), and the caches of all 40 layers (`cache_growth` of a document
    whose measured depth is zero)."""
    sizes = doc["bytes"]["ref"]
    caches = cache_growth({**doc, "decoding_batch": batch, "decoding_tokens": tokens, "bare": _no_layers()})
    return 2 * max(sizes["layers"]) + sizes["rest"] + caches


def serving_facts(folder: Path) -> dict[str, Any]:
    """What decides the serving tasks' forwards on the model at `folder`: whether its chat template takes
    `enable_thinking` (as `longform` decides it) and, per task skipped on it before anything decodes, why."""
    from evalsuite.backends.hf import assisted_generation_refusal
    from evalsuite.backends.options import BackendOptions
    from evalsuite.files.checkpoint import Checkpoint
    from evalsuite.tasks.longform import modes_of

    checkpoint = Checkpoint.open(folder)
    refusal = assisted_generation_refusal(checkpoint, BackendOptions())
    return {
        "chat_template_thinking": len(modes_of(checkpoint.load_tokenizer())) > 1,
        "serving_skipped": {"specdec": refusal} if refusal else {},
    }


def _no_layers() -> dict[str, Any]:
    return {"bare-ref": {"layer_kinds": []}}


def serving_at_size(
    doc: dict[str, Any], extrapolated: dict[str, Any], cache_growth: Any
) -> dict[str, Any] | None:
    """Per serving task and side at 40 layers: the forwards, the bytes they read and, on this machine, their
    seconds at the measured cost per forward; what a side holds while it decodes, against a 24 GB GPU; or
    None where no decoding forward was measured (the observed validation's)."""
    observed = extrapolated["runs"].get("validation-streamed")
    per_forward = (observed or {}).get("decoding_forward") or {}
    if not {"ref", "ckpt"} <= set(per_forward):
        return None
    measured = doc["runs"]["validation-streamed"]
    thinking = bool(doc.get("chat_template_thinking", False))
    skipped = doc.get("serving_skipped") or {}
    out: dict[str, Any] = {
        "measured_commit": measured.get("commit"),
        "measured_batch": doc.get("decoding_batch", 32),
        "chat_template_thinking": thinking,
        "tasks": {},
    }
    for task, count in serving_forwards(thinking).items():
        tokens = count["longest"] + 256  # the answer and a prompt's tokens: the shipped prompts are shorter
        resident = resident_bytes(doc, count["batch"], tokens, cache_growth)
        entry: dict[str, Any] = {
            **count,
            "resident_bytes": resident,
            "fits_gpu_24gb": resident <= GPU_MEMORY_BYTES,
            "sides": {
                side: {
                    "seconds": count["forwards"] * f["seconds"],
                    "bytes_read": count["forwards"] * f["bytes"],
                }
                for side, f in per_forward.items()
            },
        }
        if task in skipped:
            entry["skipped"] = skipped[task]
        out["tasks"][task] = entry
    return out


def serving_lines(serving: dict[str, Any]) -> list[str]:
    """`serving_at_size`'s figures as the lines bench/real_shape.py prints."""
    commit = (serving.get("measured_commit") or "unknown")[:7]
    lines = [
        f"serving tasks at 40 layers, each side streamed (a forward at the measured smoke decoding's cost, "
        f"batch {serving['measured_batch']}, commit {commit}):"
    ]
    for task, t in serving["tasks"].items():
        modes = f", {t['modes']} modes" if t["modes"] > 1 else ""
        head = f"  {task}: {t['prompts']} prompts, batch {t['batch']}{modes}"
        head += f": at most {t['forwards']} forwards"
        if "skipped" in t:
            lines.append(f"{head}; skipped on this model: {t['skipped']}")
            continue
        lines.append(head)
        for side, s in t["sides"].items():
            lines.append(
                f"    {side}: {s['seconds'] / 3600:.1f} h here, {s['bytes_read'] / 1e12:.2f} TB read"
            )
        fits = "fits" if t["fits_gpu_24gb"] else "does NOT fit"
        lines.append(f"    resident while decoding: {t['resident_bytes'] / 1e9:.1f} GB ({fits} a 24 GB GPU)")
    return lines
