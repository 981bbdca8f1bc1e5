"""Benchmark of the seed's model at its real shape: each task on the wide fixtures, extrapolated to 40 layers.

    python bench/real_shape.py [--layers 4|8] [--runs NAME,...] [--rounds N] [--fixtures DIR] [--quick]
                               [--prompts N [--cases M]] [--results DIR]

The fixtures are `minicpmv47-35b-a3b-wide` (MiniCPM-V-4.7-35B-A3B's real widths and 248,320 vocabulary at the
first `--layers` decoder layers of its pattern, random BF16 weights), its W4A8 copy written with the seed's
policy and its EXL3 pack (K=4, K=6 head, random trellis words), built once (`evalsuite fixtures --only ...`).
Each run is `evalsuite run` in a child process of its own, on the `python-docs` corpus, started with the
fixtures' files dropped from the page cache (every run reads its weights from the disk, as a 70 GB model
always does); its wall time, peak RSS (the kernel's, as `/usr/bin/time -v` reports it, from a small launcher
process: Linux would lend the bench's own peak to a child it forks) and the machine's load average are
recorded. `--rounds N` measures each run N times, in the listed order and then in reverse, and keeps the
median time (the shared pass's ratio to the bare forward: the median of each round's own ratio):

- the W4A8 pair: `tensors`; `ppl` loaded and streamed; `smoke` loaded (generation cannot stream); `moe`,
  `layers` streamed; `intref` loaded and streamed; and `ppl,moe,layers` streamed in one run;
- the seed's whole validation of the W4A8 pack (`tensors`, `ppl`, `smoke`, `vision`, `moe`, `intref`) in one
  streamed run, the reference observed (`validation-streamed`) or replayed (`validation-replayed`) from its
  recording (`record-ref`), with per side the greedy decoding's forwards, seconds and bytes read per forward,
  and per model loaded its set-up and layer reads (`load_figures`; of the candidate's integer execution, what
  riding the candidate's `hf` pass would save at most: `integer_execution`);
- the EXL3 pack against the same BF16 reference: `tensors`; `ppl` loaded and streamed;
- the floor: a bare streamed forward of each side (`bare_streamed_forward`: the `ppl` windows through every
  layer, one resident at a time, and the head on the scored positions; no task, nothing written), with the
  time of each layer.

Printed and written as JSON into bench/results/ (bench/figures.py: bench `real_shape`, `real_shape_8l` at 8
layers), with the machine and the git commit, every run's own commit beside it: per run its time, peak
memory, layer loads per side where the run reports them, and:
- `(ppl+moe+layers streamed) / (bare streamed forward of both sides)` (goal <= 1.3), that run's peak RSS
  (goal <= 6.5 GB at 4 layers); and the same run over that floor plus the candidate's decoder layers once
  more (`moe` and `layers` run each candidate layer on the reference's input too: work the two-pass floor
  does not count);
- loaded peak RSS / the larger side's loaded bytes (goal <= 1.25);
- at 8 layers, the streamed `ppl,moe,layers` run's peak RSS / its peak in the latest 4-layer JSON (goal
  <= 1.05: a streamed peak does not grow with depth);
- the candidate's decoding forward / the reference's in the observed validation (goal <= 1.0: it reads a
  quarter of the bytes), and EXL3's bare streamed forward / the BF16 one (goal <= 1.5);
- the floor (bench/floor.py): this machine's page-cache read, BF16 write and BF16 matmul rates, measured in
  the same call, and per decoding forward (by side) and per layer pass (each bare forward's mean layer) the
  time its bytes read, its BF16 bytes unpacked and its tokens' matmuls take at those rates, with the measured
  time over that floor;
- the extrapolation to the real 40-layer model on this machine: the time and peak memory of a publisher's
  validation of the W4A8 pack (`tensors`, `ppl`, `smoke`, `vision`, `moe`, `intref`; each task by the fastest
  run that covers it and fits the machine, a run of several tasks counted once) and of the EXL3 pack
  (`tensors`, `ppl`), beside the bare streamed
  forward of both sides. How: the 40-layer model's bytes are the fixture's non-layer bytes plus 30 Gated
  DeltaNet and 10 full-attention layers as the fixture stores them; a run's time is scaled by the bare
  forward's (fixed part + 40 layers of their measured times) / (fixed part + the fixture's layers), a
  `tensors` run's by the bytes; a loaded run's peak grows by the extra bytes loaded, a streamed run's peak
  does not grow with depth (`--layers 8` shows how far that holds).

A streamed decoding reads every decoder layer (of a MoE layer, the experts its tokens route to) per forward,
so on the wide pair a forward costs seconds: `--prompts N` (and `--cases M`) runs `smoke` on its first N
prompts and `vision` on its first M cases (its single image kept), enough to measure a forward's cost, and the
extrapolation counts the whole sets' forwards (per smoke batch its longest answer, per vision case its own:
the random pair's answers all run to their limit) at that cost: a streamed side decodes every prompt in the
spec's batches, ordered by budget, the same batches on both sides. Where only
the observed validation was measured, the replayed one and the recording are derived from it by side (the
reference's observations are the recording; the rest is what a replay still runs), and said so.

The serving tasks (`longform`, `tools`, `specdec`) are not run on the wide pair: they only decode, so their
forwards are counted from the shipped specs and priced at the observed validation's decoding forward, per
side, at 40 layers, with what a side holds while it decodes against a 24 GB GPU (bench/serving_at_size.py;
docs/scale.md's table is rendered from it).

`--runs` runs only the named runs and keeps the others' figures from the bench's latest JSON file (its `data`:
so that the benchmark can be run in pieces on a shared machine; the file is rewritten after each run, and the
new one supersedes the old); `--quick` runs a few runs on the tiny pair (tens of seconds), to check the
script. These machines are shared: the load averages say how busy each run's machine was.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from figures import (
    TEST_FIXTURES,
    Figures,
    add_arguments,
    bench_machine,
    git_commit,
    latest,
    own_peak,
    recorded,
    with_own_peak,
)
from floor import active_parameters, floor_seconds, machine_rates
from serving_at_size import serving_at_size, serving_facts, serving_lines

from evalsuite import tune_allocator
from evalsuite.backends.memory import loaded_bytes
from evalsuite.backends.options import BackendOptions
from evalsuite.contract.spec import default_spec_path, load_spec
from evalsuite.files.checkpoint import Checkpoint
from evalsuite.files.digest import DigestCache
from evalsuite.fixtures import build_fixtures
from evalsuite.fixtures.names import DEFAULT_WIDE_LAYERS, TINY_BF16, TINY_EXL3, TINY_W4A8, wide_names
from evalsuite.tasks.smoke import SmokeSpec

REAL_LAYERS = 40
REAL_LAYER_TYPES = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(REAL_LAYERS)]
RESULTS = Path(__file__).parent / "results"
DECODER_LAYER = re.compile(r"model\.language_model\.layers\.(\d+)\.")
CORPUS = "python-docs"
STREAM_GOAL = 1.3
LOADED_GOAL = 1.25
DEPTH_GOAL = 1.05
STREAMED_PEAK_GOAL_GB = 6.5
# Issue 72's goals: the candidate's decoding forward against the reference's (it reads a quarter of the
# bytes), and EXL3's bare streamed forward against the BF16 one.
DECODING_GOAL = 1.0
EXL3_BARE_GOAL = 1.5
LOADED_RUNS = ("ppl-loaded", "intref-loaded", "smoke-loaded", "exl3-ppl-loaded")
W4A8_VALIDATION = ("tensors", "ppl", "smoke", "vision", "moe", "intref")
SEED_VALIDATION = ",".join(W4A8_VALIDATION)
# What a recording of the reference holds for that validation (`tensors` reads both checkpoints' files).
RECORDED = ",".join(t for t in W4A8_VALIDATION if t != "tensors")
RECORDING = "recording"
# The seed's validation as a publisher runs it, by what each run is (the page names them so).
SEED_RUNS = {
    "validation-replayed": "nightly validation of the W4A8 pack, reference replayed",
    "validation-streamed": "validation of the W4A8 pack, reference observed",
    "record-ref": "one-time recording of the reference (answers included)",
}
SEED_GOALS = {"validation-replayed": "<= 30"}
EXL3_VALIDATION = ("tensors", "ppl")
# `--prompts N`: smoke's and vision's specs cut to their first N prompts and cases, by task (set by `main`);
# the decoding's seconds are then scaled to the whole sets' forwards (`decoding_scale`, by side).
SUBSET_SPECS: dict[str, Path] = {}


@dataclass(frozen=True)
class Run:
    """One `evalsuite run`: the candidate (`w4a8` or `exl3`) against the BF16 reference, its tasks, and
    whether both sides stream. `kind` `record`: `evalsuite record` of the reference alone (the recording
    kept for the runs of kind `replay`, whose reference it is)."""

    candidate: str
    tasks: str
    streamed: bool
    kind: str = "run"

    def args(self, ref: Path, ckpt: Path, out: Path, recording: Path | None = None) -> list[str]:
        stream = ["--stream"] if self.streamed else []
        stream += [arg for task, path in SUBSET_SPECS.items() if task in self.tasks.split(",")
                   for arg in ("--spec", f"{task}={path}")]  # fmt: skip
        if self.kind == "record":
            args = [
                "record",
                "--ckpt",
                str(ref),
                "--tasks",
                self.tasks,
                "--corpus",
                CORPUS,
                "--out",
                str(out),
            ]
            return [*args, "--quiet", *stream]
        reference = recording if self.kind == "replay" and recording is not None else ref
        args = [
            "run",
            "--ref",
            str(reference),
            "--ckpt",
            str(ckpt),
            "--tasks",
            self.tasks,
            "--corpus",
            CORPUS,
        ]
        return [*args, "--out", str(out), "--no-resume", "--quiet", *stream]


RUNS = {
    "tensors": Run("w4a8", "tensors", streamed=False),
    "ppl-loaded": Run("w4a8", "ppl", streamed=False),
    "ppl-streamed": Run("w4a8", "ppl", streamed=True),
    "smoke-loaded": Run("w4a8", "smoke", streamed=False),
    "moe-streamed": Run("w4a8", "moe", streamed=True),
    "layers-streamed": Run("w4a8", "layers", streamed=True),
    "intref-loaded": Run("w4a8", "intref", streamed=False),
    "intref-streamed": Run("w4a8", "intref", streamed=True),
    "ppl-moe-layers-streamed": Run("w4a8", "ppl,moe,layers", streamed=True),
    # The seed's whole validation of the W4A8 pack in one streamed run: the reference observed, then replayed
    # from its recording (made once, by `record-ref`).
    "validation-streamed": Run("w4a8", SEED_VALIDATION, streamed=True),
    "record-ref": Run("w4a8", RECORDED, streamed=True, kind="record"),
    "validation-replayed": Run("w4a8", SEED_VALIDATION, streamed=True, kind="replay"),
    "exl3-tensors": Run("exl3", "tensors", streamed=False),
    "exl3-ppl-loaded": Run("exl3", "ppl", streamed=False),
    "exl3-ppl-streamed": Run("exl3", "ppl", streamed=True),
}
BARE = ("bare-ref", "bare-w4a8", "bare-exl3")
QUICK_RUNS = ("tensors", "ppl-streamed", "bare-ref", "bare-w4a8", "bare-exl3")


def bare_streamed_forward(folder: Path) -> dict[str, Any]:
    """The floor under every streamed task: one side's `ppl` windows through each decoder layer, one layer
    resident at a time, then the head on the scored positions. Nothing is kept or written."""
    import torch

    from evalsuite.backends.streamed import StreamedBackend
    from evalsuite.pipeline.runner import build_tasks
    from evalsuite.protocol.side import Side
    from evalsuite.protocol.task import RunContext

    started = time.perf_counter()
    checkpoint = Checkpoint.open(folder)
    # Resolved from the pack's format, as `evalsuite run` resolves it: an EXL3 pack runs through backend exl3.
    options = BackendOptions(backend="auto", stream=True).for_format(checkpoint.format)
    (ppl,) = build_tasks(["ppl"], RunContext(corpus_name=CORPUS), {})
    side = Side("ref", options, checkpoint)
    windows = torch.from_numpy(ppl.prepare(side, side)["windows"])
    scored = ppl.spec.protocol.scored
    positions = torch.arange(scored.first, scored.last + 1)

    model = StreamedBackend(checkpoint, options)  # embeddings, vision tower, norm and head resident
    calls = [model.capture(window) for window in windows]
    states = [call.hidden for call in calls]
    layer_seconds = []
    for index in range(model.n_layers):
        layer_started = time.perf_counter()
        with model.resident(index) as layer:
            states = [model.forward_layer(layer, index, h, c) for h, c in zip(states, calls, strict=True)]
        layer_seconds.append(time.perf_counter() - layer_started)
    for hidden, call in zip(states, calls, strict=True):
        model.head_logits(hidden, call, positions)
    return {
        "seconds": time.perf_counter() - started,
        "layer_seconds": layer_seconds,
        "layer_kinds": model.layer_kinds(),
        "backend": options.backend,
        "windows": list(windows.shape),
    }


def evict_page_cache(folders: list[Path]) -> None:
    """Drop the page cache's copy of every file in `folders` (`POSIX_FADV_DONTNEED`, no root needed), so that
    every run reads its weights from the disk, as a 70 GB model always does, and no run gains from the one
    before it having read the same files."""
    for folder in folders:
        for path in sorted(folder.iterdir()):
            if path.is_file():
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)


def measured(command: list[str]) -> dict[str, Any]:
    """A child process's exit status, wall seconds, peak RSS (bytes: the kernel's own count for that process,
    as `/usr/bin/time -v` reads it, through `figures.with_own_peak`), stdout, and the load averages at its
    start and end."""
    load_before = os.getloadavg()[0]
    with (
        tempfile.TemporaryFile("w+") as stdout,
        tempfile.TemporaryFile("w+") as stderr,
        tempfile.TemporaryDirectory() as tmp,
    ):
        usage_file = Path(tmp) / "usage.json"
        started = time.perf_counter()
        launched = with_own_peak(command, usage_file)
        child = subprocess.run(launched, stdout=stdout, stderr=stderr, text=True, check=False)
        seconds = time.perf_counter() - started
        stdout.seek(0)
        stderr.seek(0)
        output, errors = stdout.read(), stderr.read()
        peak = own_peak(usage_file)
    if child.returncode not in (0, 1):
        print(f"  exited with {child.returncode}: {errors[-1500:]}", file=sys.stderr)
    return {
        "exit": child.returncode,
        "seconds": round(seconds, 2),
        "peak_rss": peak,
        "stdout": output,
        "load_average": [round(load_before, 2), round(os.getloadavg()[0], 2)],
    }


def layer_loads(results: dict[str, Any]) -> Any:
    """The layer loads a run reports anywhere in its results.json (a key naming them), else None."""

    def found(node: Any) -> Iterator[tuple[str, Any]]:
        if isinstance(node, dict):
            for key, value in node.items():
                if "layer_loads" in key:
                    yield key, value
                else:
                    yield from found(value)
        elif isinstance(node, list):
            for value in node:
                yield from found(value)

    loads = dict(found(results))
    return loads or None


def unit_bytes(folder: Path) -> dict[str, Any]:
    """A checkpoint's bytes on disk and loaded (`loaded_bytes`, backend hf): outside the decoder layers and
    per layer index."""
    checkpoint = Checkpoint.open(folder)
    rest, layers = 0, {}
    for name, info in checkpoint.tensors.items():
        match = DECODER_LAYER.match(name)
        if match:
            layers[int(match.group(1))] = layers.get(int(match.group(1)), 0) + info.nbytes
        else:
            rest += info.nbytes
    return {
        "files": checkpoint.total_bytes,
        "loaded": loaded_bytes(checkpoint, BackendOptions()),
        "rest": rest,
        "layers": [layers[i] for i in sorted(layers)],
    }


def at_real_depth(rest: float, per_layer: list[float], kinds: list[str]) -> float:
    """`rest` plus 40 layers of the real pattern, each layer costing the mean of the measured layers of its
    kind (Gated DeltaNet or full attention)."""
    by_kind: dict[str, list[float]] = {}
    for value, kind in zip(per_layer, kinds, strict=True):
        by_kind.setdefault(kind, []).append(value)
    mean = {kind: sum(v) / len(v) for kind, v in by_kind.items()}
    return rest + sum(mean[kind] for kind in REAL_LAYER_TYPES)


def extrapolate(doc: dict[str, Any], machine_bytes: int) -> dict[str, Any]:
    """The 40-layer figures from the measured ones (module docstring)."""
    kinds = doc["bare"]["bare-ref"]["layer_kinds"]
    out: dict[str, Any] = {"bare_40": {}, "runs": {}}
    for name, bare in doc["bare"].items():
        rest = bare["seconds"] - sum(bare["layer_seconds"])
        out["bare_40"][name] = at_real_depth(rest, bare["layer_seconds"], bare["layer_kinds"])
    sizes = doc["bytes"]
    files_40 = {
        side: at_real_depth(s["rest"], s["layers"], kinds) * s["files"] / (s["rest"] + sum(s["layers"]))
        for side, s in sizes.items()
    }
    # Every side holds about the reference's BF16 bytes once loaded (a W4A8 or EXL3 pack decompressed), so
    # its loaded bytes grow with depth as the reference's files do (its own files compress unevenly).
    deeper = files_40["ref"] / sizes["ref"]["files"]
    loaded_40 = {side: s["loaded"] * deeper for side, s in sizes.items()}
    layers_40 = {
        side: at_real_depth(0.0, s["layers"], kinds) / sum(s["layers"])
        for side, s in sizes.items()
        if s["layers"]
    }
    for name, run in doc["runs"].items():
        spec = RUNS[name]
        cand = spec.candidate
        if f"bare-{cand}" not in doc["bare"]:
            continue  # no floor of this candidate measured: nothing to scale by
        if run.get("decoding") or spec.kind == "record":
            decoded = decoding_at_depth(name, doc, out, layers_40, machine_bytes)
            if decoded is not None:
                out["runs"][name] = decoded
            continue
        bare_now = doc["bare"]["bare-ref"]["seconds"] + doc["bare"][f"bare-{cand}"]["seconds"]
        bare_40 = out["bare_40"]["bare-ref"] + out["bare_40"][f"bare-{cand}"]
        if spec.tasks == "tensors":
            now = sizes["ref"]["files"] + sizes[cand]["files"]
            scale = (files_40["ref"] + files_40[cand]) / now
        else:
            scale = bare_40 / bare_now
        peak = run["peak_rss"]
        if not spec.streamed and spec.tasks != "tensors":
            # A loaded run holds the larger side whole: its peak grows by that side's extra loaded bytes.
            grown = max(loaded_40[s] - sizes[s]["loaded"] for s in ("ref", cand))
            peak += grown
        layers = len(doc["bare"]["bare-ref"]["layer_seconds"])
        seconds_40 = run["seconds"] * scale
        out["runs"][name] = {
            "seconds": seconds_40,
            "seconds_per_layer": (seconds_40 - run["seconds"]) / (REAL_LAYERS - layers),
            "peak_rss": peak,
            "fits_machine": peak <= machine_bytes,
        }
    out["bytes_40"] = {"files": files_40, "loaded": loaded_40}
    out["validations"] = {
        "w4a8": validation(out, W4A8_VALIDATION, "w4a8"),
        "exl3": validation(out, EXL3_VALIDATION, "exl3"),
    }
    observed = out["runs"].get("validation-streamed")
    if observed is not None and observed.get("ref_side_seconds") is not None:
        # Not measured here: the replayed validation and the recording, from the observed run's split by side
        # (its reference's observations make the recording; the rest is what a replay still runs).
        why = "derived from validation-streamed, split by side"
        ref_40 = observed["ref_side_seconds"]
        for name, seconds in (("validation-replayed", observed["seconds"] - ref_40), ("record-ref", ref_40)):
            if name not in doc["runs"]:
                kept = "ref" if name == "record-ref" else "ckpt"  # the side this run decodes
                out["runs"][name] = {
                    **observed,
                    "seconds": seconds,
                    **{
                        key: {side: v for side, v in observed.get(key, {}).items() if side == kept}
                        for key in ("decoding_forward", "decoding_seconds")
                    },
                    "derived": why,
                }
    serving = serving_at_size(doc, out, cache_growth)
    if serving is not None:
        out["serving"] = serving
    return out


def decoding_at_depth(
    name: str, doc: dict[str, Any], out: dict[str, Any], layers_40: dict[str, float], machine_bytes: int
) -> dict[str, Any] | None:
    """A run that decodes, at 40 layers: its decoding forwards cost what each reads (every layer once, its
    routed experts only), so their seconds and bytes grow as the decoder layers' bytes do (per side); the
    rest of the run as the bare forward's time does. Its peak grows by the decoding caches of the 36 more
    layers (`cache_growth`). A recording (`record-ref`) is the reference's side of the streamed validation:
    scaled as that side is there."""
    run, spec = doc["runs"][name], RUNS[name]
    bare_now = doc["bare"]["bare-ref"]["seconds"] + doc["bare"][f"bare-{spec.candidate}"]["seconds"]
    scale = (out["bare_40"]["bare-ref"] + out["bare_40"][f"bare-{spec.candidate}"]) / bare_now
    side_of = {"ref": "ref", "ckpt": spec.candidate}
    if spec.kind == "record":
        source = doc["runs"].get("validation-streamed", {}).get("decoding", {}).get("ref")
        if source is None:
            return None
        decoding = {"ref": {**source, "seconds": run["seconds"] * source["seconds"] / source["side_seconds"]}}
    else:
        decoding = run["decoding"]
    decoded = sum(d["seconds"] for d in decoding.values())
    # Run on a cut of the prompt sets: the whole sets' decoding forwards, each at the measured cost.
    scales = doc.get("decoding_scale", 1.0)

    def whole(side: str) -> float:
        # A float: a JSON from before each side had its own batches.
        return float(scales[side] if isinstance(scales, dict) else scales)

    decoding_40 = {s: d["seconds"] * layers_40[side_of[s]] * whole(s) for s, d in decoding.items()}
    seconds_40 = (run["seconds"] - decoded) * scale + sum(decoding_40.values())
    per_forward = {
        side: {
            "seconds": d["seconds_per_forward"] * layers_40[side_of[side]],
            "bytes": d["bytes_per_forward"] * layers_40[side_of[side]],
            "share_of_layers_bytes": d["bytes_per_forward"] / d["layers_bytes"],
        }
        for side, d in decoding.items()
    }
    peak = run["peak_rss"] + cache_growth(doc)
    ref = decoding.get("ref")
    # The reference's side alone at 40 layers: what a recording of it costs, and what a replay saves.
    ref_40 = None
    if ref is not None and spec.kind != "record":
        own = ref["seconds"] * layers_40["ref"] * whole("ref")
        ref_40 = (ref["side_seconds"] - ref["seconds"]) * scale + own
    integer = integer_execution(run, layers_40[spec.candidate], doc["runs"].get("ppl-moe-layers-streamed"))
    return {
        **({"integer_execution": integer} if integer is not None else {}),
        "ref_side_seconds": ref_40,
        "seconds": seconds_40,
        "seconds_per_layer": (seconds_40 - run["seconds"]) / (REAL_LAYERS - doc["layers"]),
        "peak_rss": peak,
        "fits_machine": peak <= machine_bytes,
        "decoding_forward": per_forward,
        # The whole sets' greedy decoding by side; the rest of `seconds` is what does not decode (loads, the
        # shared pass with the teacher-forced answers, intref).
        "decoding_seconds": decoding_40,
    }


def undecoded_seconds(run: dict[str, Any]) -> float:
    """An extrapolated run's seconds that its greedy decoding (`decoding_seconds`) does not account for."""
    return run["seconds"] - sum(run["decoding_seconds"].values())


def cache_growth(doc: dict[str, Any]) -> float:
    """Bytes more a decoding's caches hold at 40 layers than at the fixture's depth, for one batch of smoke's
    prompts: per Gated DeltaNet layer and prompt its recurrent state (value heads × key dim × value dim, in
    float32) and convolution state, per attention layer and token its keys and values (BF16)."""
    config = doc.get("text_config") or {}
    batch, tokens = doc.get("decoding_batch", 32), doc.get("decoding_tokens", 128)
    v_heads, k_dim = config.get("linear_num_value_heads", 32), config.get("linear_key_head_dim", 128)
    v_dim, k_heads = config.get("linear_value_head_dim", 128), config.get("linear_num_key_heads", 16)
    conv = config.get("linear_conv_kernel_dim", 4) * (2 * k_heads * k_dim + v_heads * v_dim) * 4
    gdn = batch * (v_heads * k_dim * v_dim * 4 + conv)
    attention = batch * tokens * 2 * config.get("num_key_value_heads", 2) * config.get("head_dim", 256) * 2
    now = doc["bare"]["bare-ref"]["layer_kinds"]
    grow = {"linear_attention": gdn, "full_attention": attention}
    return sum(grow.get(k, 0) for k in REAL_LAYER_TYPES) - sum(grow.get(k, 0) for k in now)


def validation(extrapolated: dict[str, Any], tasks: tuple[str, ...], candidate: str) -> dict[str, Any]:
    """A publisher's validation at 40 layers: each task by a run that covers it (a run of several tasks, as
    `ppl,moe,layers` streamed, covers each of them and counts once), one that fits the machine where any does
    (the fastest of those), else the fastest measured; its time, its peak, and the floor (the bare streamed
    forward of both sides)."""
    runs = extrapolated["runs"]
    bare = f"bare-{candidate}"
    chosen: dict[str, str] = {}
    for task in tasks:
        covering = [
            name for name in runs if RUNS[name].candidate == candidate and task in RUNS[name].tasks.split(",")
        ]
        fitting = [name for name in covering if runs[name]["fits_machine"]]
        shared = [name for name in fitting if name in chosen.values()]
        pool = shared or fitting or covering
        if pool:
            chosen[task] = min(pool, key=lambda name: runs[name]["seconds"])
    missing = [t for t in tasks if t not in chosen]
    distinct = set(chosen.values())
    return {
        "runs": chosen,
        "missing": missing,
        "seconds": sum(runs[r]["seconds"] for r in distinct),
        "peak_rss": max((runs[r]["peak_rss"] for r in distinct), default=0),
        "fits_machine": all(runs[r]["fits_machine"] for r in distinct),
        "floor_seconds": (
            extrapolated["bare_40"]["bare-ref"] + extrapolated["bare_40"][bare]
            if bare in extrapolated["bare_40"]
            else None
        ),
    }


def gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


def load_text(run: dict[str, Any]) -> str:
    """A run's load averages at its start and end."""
    start, end = run["load_average"]
    return f"{start:>4.1f}-{end:<4.1f}"


def short_commit(commit: str | None) -> str:
    """A run's commit in 7 digits, `+dirty` kept; `n/a` for a run recorded without one."""
    if not commit:
        return "n/a"
    return commit[:7] + ("+dirty" if commit.endswith("+dirty") else "")


def report(doc: dict[str, Any]) -> None:
    """The figures for people. A run measured in an earlier sitting (`--runs`) shows its own commit."""
    n = doc["layers"]
    print(f"{doc['fixtures']['ref']} ({n} layers), {gb(doc['memory_bytes'])} of memory")
    for side, sizes in doc["bytes"].items():
        print(f"  {side}: files {gb(sizes['files'])}, loaded {gb(sizes['loaded'])}")
    print(f"\n{'run':<26}{'seconds':>9}{'per layer':>11}{'peak RSS':>12}  load avg   commit   layer loads")
    for name, run in doc["runs"].items():
        extrapolated = doc.get("extrapolated", {}).get("runs", {}).get(name)
        per_layer = f"{extrapolated['seconds_per_layer']:.1f}" if extrapolated else "n/a"
        loads = json.dumps(run["layer_loads"]) if run.get("layer_loads") else "n/a"
        print(
            f"{name:<26}{run['seconds']:>9.1f}{per_layer:>11}{gb(run['peak_rss']):>12}"
            f"  {load_text(run)}  {short_commit(run.get('commit')):<7}  {loads}"
        )
    for name, bare in doc["bare"].items():
        layers = " ".join(f"{s:.1f}" for s in bare["layer_seconds"])
        print(
            f"{name:<26}{bare['seconds']:>9.1f}{'':>11}{gb(bare['peak_rss']):>12}"
            f"  {load_text(bare)}  {short_commit(bare.get('commit')):<7}  layers: {layers} s"
        )
    ratios = doc.get("ratios", {})
    if "streamed_over_bare" in ratios:
        rounds = ratios.get("streamed_over_bare_rounds")
        by_round = f", the median of its rounds' {', '.join(f'{r:.2f}' for r in rounds)}" if rounds else ""
        print(
            f"\n(ppl+moe+layers streamed) / (bare streamed forward of both sides) = "
            f"{ratios['streamed_over_bare']:.2f}{by_round}  (goal <= {STREAM_GOAL})"
        )
    if "streamed_over_bare_and_fed" in ratios:
        print(
            f"(ppl+moe+layers streamed) / (that floor + the candidate's layers once more, fed the reference's"
            f" input on the fed windows) = {ratios['streamed_over_bare_and_fed']:.2f}"
        )
    if "streamed_peak_over_shallower" in ratios:
        print(
            f"ppl-moe-layers-streamed: peak RSS / its peak at {doc['shallower']['layers']} layers = "
            f"{ratios['streamed_peak_over_shallower']:.3f}  (goal <= {DEPTH_GOAL})"
        )
    for name in LOADED_RUNS:
        if f"{name}_peak_over_loaded_bytes" in ratios:
            value = ratios[f"{name}_peak_over_loaded_bytes"]
            print(f"{name}: peak RSS / larger side's loaded bytes = {value:.2f}  (goal <= {LOADED_GOAL})")
    if "decoding_forward_ckpt_over_ref" in ratios:
        value = ratios["decoding_forward_ckpt_over_ref"]
        print(f"decoding forward, candidate / reference = {value:.2f}  (goal <= {DECODING_GOAL})")
    if "bare_exl3_over_bare_ref" in ratios:
        value = ratios["bare_exl3_over_bare_ref"]
        print(f"bare streamed forward, EXL3 / BF16 = {value:.2f}  (goal <= {EXL3_BARE_GOAL})")
    if doc.get("floors"):
        print("\n".join(floor_lines(doc)))
    for name, run in doc["runs"].items():
        for side, d in (run.get("decoding") or {}).items():
            share = d["bytes_per_forward"] / d["layers_bytes"]
            print(
                f"{name}, {side} decoding: {d['forwards']} forwards, {d['seconds_per_forward']:.2f} s and "
                f"{gb(d['bytes_per_forward'])} read per forward ({share:.0%} of its decoder layers' bytes: "
                "routed experts only)"
            )
    extrapolated = doc.get("extrapolated")
    if not extrapolated:
        return
    print(f"\nextrapolated to {REAL_LAYERS} layers on this machine ({gb(doc['memory_bytes'])} RAM):")
    for name, what in SEED_RUNS.items():
        run = extrapolated["runs"].get(name)
        if run is None:
            continue
        fits = "fits" if run["fits_machine"] else "does NOT fit this machine's memory"
        how = f" [{run['derived']}]" if run.get("derived") else ""
        print(f"  {what}: {run['seconds'] / 60:.0f} min, peak {gb(run['peak_rss'])} ({fits}){how}")
        for side, f in run.get("decoding_forward", {}).items():
            print(f"    {side} decoding: {f['seconds']:.1f} s and {gb(f['bytes'])} read per forward")
        if "decoding_seconds" in run:
            parts = [f"{side} decoding {s / 60:.0f} min" for side, s in run["decoding_seconds"].items()]
            rest = undecoded_seconds(run) / 60
            print(f"    of which {', '.join(parts)}; the rest (what does not decode) {rest:.0f} min")
        if "integer_execution" in run:
            i = run["integer_execution"]
            saves = i["shared_pass_saves_at_most"] / 60
            print(
                f"    of the rest, the integer execution (intref) {i['seconds'] / 60:.1f} min: its set-up "
                f"{i['set_up_seconds']:.0f} s and layer reads {i['layer_read_seconds']:.0f} s (from the page "
                f"cache) are what riding the candidate's pass would save, at most {saves:.1f} min"
            )
            if "shared_pass_saves_at_most_from_disk" in i:
                disk = i["shared_pass_saves_at_most_from_disk"] / 60
                print(f"      its layers read from the disk instead: at most {disk:.1f} min")
    for what, v in extrapolated["validations"].items():
        if not v["runs"]:
            print(f"  {what} validation: not extrapolated (needs its runs and the bare-{what} floor)")
            continue
        runs = ", ".join(f"{task}: {run}" for task, run in v["runs"].items())
        fits = "fits" if v["fits_machine"] else "does NOT fit this machine's memory"
        floor = "not measured" if v["floor_seconds"] is None else f"{v['floor_seconds'] / 60:.0f} min"
        print(
            f"  {what} validation ({runs}): {v['seconds'] / 60:.0f} min, peak {gb(v['peak_rss'])} ({fits}); "
            f"bare streamed forward of both sides {floor}"
            + (f"; not measured: {', '.join(v['missing'])}" if v["missing"] else "")
        )
    if "serving" in extrapolated:
        print("\n" + "\n".join(serving_lines(extrapolated["serving"])))


def summarise(doc: dict[str, Any]) -> None:
    """Ratios and the extrapolation, from whatever runs the document holds."""
    ratios: dict[str, float] = {}
    runs, bare, sizes = doc["runs"], doc["bare"], doc["bytes"]
    if "ppl-moe-layers-streamed" in runs and {"bare-ref", "bare-w4a8"} <= set(bare):
        floor = bare["bare-ref"]["seconds"] + bare["bare-w4a8"]["seconds"]
        ratios["streamed_over_bare"] = runs["ppl-moe-layers-streamed"]["seconds"] / floor
        # Measured over several rounds in one call: the ratio of each round's runs (made next to each other,
        # the order reversed every other round), and their median, which a drift of the machine's speed
        # between rounds does not move as it moves a ratio of medians.
        paired = [
            run.get("seconds_rounds")
            for run in (runs["ppl-moe-layers-streamed"], bare["bare-ref"], bare["bare-w4a8"])
        ]
        if all(paired) and len({len(r) for r in paired}) == 1 and len(paired[0]) > 1:
            by_round = [a / (b + c) for a, b, c in zip(*paired, strict=True)]
            ratios["streamed_over_bare_rounds"] = by_round
            ratios["streamed_over_bare"] = statistics.median(by_round)
        # `moe` and `layers` also run each candidate layer on the reference's input to it (their "given the
        # same input" figures) on their spec's [fed] windows: that share of a third forward of the
        # candidate's layers, beyond the two the floor counts (known for runs that recorded the share).
        share = runs["ppl-moe-layers-streamed"].get("fed_share")
        if share is not None:
            fed = share * sum(bare["bare-w4a8"]["layer_seconds"])
            ratios["streamed_over_bare_and_fed"] = runs["ppl-moe-layers-streamed"]["seconds"] / (floor + fed)
    shallower = doc.get("shallower")
    if shallower and "ppl-moe-layers-streamed" in runs:
        peak = runs["ppl-moe-layers-streamed"]["peak_rss"]
        ratios["streamed_peak_over_shallower"] = peak / shallower["streamed_peak_rss"]
    for name, run in runs.items():
        spec = RUNS[name]
        if not spec.streamed and spec.tasks != "tensors":
            larger = max(sizes["ref"]["loaded"], sizes[spec.candidate]["loaded"])
            ratios[f"{name}_peak_over_loaded_bytes"] = run["peak_rss"] / larger
    decoded = runs.get("validation-streamed", {}).get("decoding") or {}
    if {"ref", "ckpt"} <= set(decoded):
        ratios["decoding_forward_ckpt_over_ref"] = (
            decoded["ckpt"]["seconds_per_forward"] / decoded["ref"]["seconds_per_forward"]
        )
    if {"bare-ref", "bare-exl3"} <= set(bare):
        ratios["bare_exl3_over_bare_ref"] = bare["bare-exl3"]["seconds"] / bare["bare-ref"]["seconds"]
    doc["ratios"] = ratios
    if doc.get("floor_rates"):
        doc["floors"] = floors(doc)
    if "bare-ref" in bare and len(bare) > 1:
        doc["extrapolated"] = extrapolate(doc, doc["memory_bytes"])


def floors(doc: dict[str, Any]) -> dict[str, Any]:
    """Per decoding forward (the observed validation's, by side) and per layer pass (each bare forward's
    layers), the floor its bytes and arithmetic set at the machine's measured rates (bench/floor.py), and the
    measured time over it."""
    rates, config, sizes = doc["floor_rates"], doc.get("text_config") or {}, doc["bytes"]
    ref_layers = sizes["ref"]["layers"]
    parameters = [active_parameters(b, config) for b in ref_layers]
    side_of = {"ref": "ref", "ckpt": "w4a8"}
    out: dict[str, Any] = {"decoding_forward": {}, "layer_pass": {}}
    for side, d in (doc["runs"].get("validation-streamed", {}).get("decoding") or {}).items():
        # A quantized side writes the BF16 its routed experts unpack to: its bytes read, grown as its layers'
        # bytes grow to the reference's.
        grown = sum(ref_layers) / sum(sizes[side_of[side]]["layers"])
        written = d["bytes_per_forward"] * grown if side != "ref" else 0.0
        floor = floor_seconds(
            rates, d["bytes_per_forward"], written, rates["decoding_tokens"], sum(parameters), "decoding"
        )
        out["decoding_forward"][side] = {**floor, "measured": d["seconds_per_forward"]}
    for name, bare in doc["bare"].items():
        side = name.removeprefix("bare-")
        if side not in sizes or len(sizes[side]["layers"]) != len(bare["layer_seconds"]):
            continue
        parts = [
            floor_seconds(
                rates,
                read,
                ref_bytes if side != "ref" else 0.0,
                rates["window_tokens"],
                n,
                "window",
            )
            for read, ref_bytes, n in zip(sizes[side]["layers"], ref_layers, parameters, strict=True)
        ]
        floor = {key: sum(p[key] for p in parts) / len(parts) for key in parts[0]}
        measured = sum(bare["layer_seconds"]) / len(bare["layer_seconds"])
        out["layer_pass"][side] = {**floor, "measured": measured}
    for entry in [*out["decoding_forward"].values(), *out["layer_pass"].values()]:
        entry["ratio"] = entry["measured"] / entry["seconds"]
    return out


def floor_lines(doc: dict[str, Any]) -> list[str]:
    """The floors as `report` prints them."""
    rates = doc["floor_rates"]
    matmul = rates["matmul_flops_per_second"]
    lines = [
        f"the floor, at this machine's rates (measured {rates.get('measured', 'with the runs')}, load "
        f"{rates['load_average'][0]:.2f}): page-cache read {rates['read_bytes_per_second'] / 1e9:.1f} GB/s, "
        f"BF16 write {rates['write_bytes_per_second'] / 1e9:.1f} GB/s, BF16 matmul "
        f"{matmul['decoding'] / 1e9:.0f} GFLOP/s at {rates['decoding_tokens']} rows, "
        f"{matmul['window'] / 1e9:.0f} at {rates['window_tokens']}"
    ]
    for what, by_side in (("decoding forward", "decoding_forward"), ("layer pass", "layer_pass")):
        for side, f in doc["floors"][by_side].items():
            lines.append(
                f"  {what}, {side}: measured {f['measured']:.2f} s, floor {f['seconds']:.2f} s (read "
                f"{f['read']:.2f}, write {f['write']:.2f}, matmul {f['matmul']:.2f}): "
                f"{f['ratio']:.1f}x the floor"
            )
    return lines


def add_figures(doc: dict[str, Any], figures: Figures) -> None:
    """What `report` prints, as the figures of the JSON (replacing any recorded before)."""
    figures.figures.clear()
    figures.add("decoder layers measured", doc["layers"])
    for side, sizes in doc["bytes"].items():
        figures.add(f"{side}: files", sizes["files"] / 1e9, "GB")
        figures.add(f"{side}: loaded", sizes["loaded"] / 1e9, "GB")
    for name, run in [*doc["runs"].items(), *doc["bare"].items()]:
        figures.add(f"{name}: time", run["seconds"], "s")
        # The streamed peak's goal is set at the default depth; deeper, it is read against that depth's.
        streamed_goal = ("ppl-moe-layers-streamed", "validation-streamed", "validation-replayed")
        at_default_depth = name in streamed_goal and doc["layers"] == DEFAULT_WIDE_LAYERS
        goal = f"<= {STREAMED_PEAK_GOAL_GB}" if at_default_depth else None
        figures.add(f"{name}: peak RSS", run["peak_rss"] / 1e9, "GB", goal=goal)
    ratios = doc.get("ratios", {})
    if "streamed_over_bare" in ratios:
        what = "(ppl+moe+layers streamed) / (bare streamed forward of both sides)"
        figures.add(what, ratios["streamed_over_bare"], goal=f"<= {STREAM_GOAL}")
    if "streamed_over_bare_and_fed" in ratios:
        what = "(ppl+moe+layers streamed) / (bare streamed forward of both sides + candidate's fed layers)"
        figures.add(what, ratios["streamed_over_bare_and_fed"])
    if "streamed_peak_over_shallower" in ratios:
        what = f"ppl-moe-layers-streamed: peak RSS / its peak at {doc['shallower']['layers']} layers"
        figures.add(what, ratios["streamed_peak_over_shallower"], goal=f"<= {DEPTH_GOAL}")
    for name in LOADED_RUNS:
        if f"{name}_peak_over_loaded_bytes" in ratios:
            what = f"{name}: peak RSS / the larger side's loaded bytes"
            figures.add(what, ratios[f"{name}_peak_over_loaded_bytes"], goal=f"<= {LOADED_GOAL}")
    if "decoding_forward_ckpt_over_ref" in ratios:
        what = "validation-streamed: decoding forward, candidate / reference"
        figures.add(what, ratios["decoding_forward_ckpt_over_ref"], goal=f"<= {DECODING_GOAL}")
    if "bare_exl3_over_bare_ref" in ratios:
        what = "bare streamed forward, EXL3 / BF16"
        figures.add(what, ratios["bare_exl3_over_bare_ref"], goal=f"<= {EXL3_BARE_GOAL}")
    for by_side, what in (("decoding_forward", "decoding forward"), ("layer_pass", "layer pass")):
        for side, f in (doc.get("floors") or {}).get(by_side, {}).items():
            figures.add(f"{what}, {side}: floor (read + write + matmul)", f["seconds"], "s")
            figures.add(f"{what}, {side}: measured / floor", f["ratio"])
    extrapolated = doc.get("extrapolated")
    if not extrapolated:
        return
    at_40 = f"{REAL_LAYERS} layers (35B)"
    for kind, sides in extrapolated["bytes_40"].items():
        for side, size in sides.items():
            figures.add(f"{at_40}, {side}: {kind}", size / 1e9, "GB")
    for name, seconds in extrapolated["bare_40"].items():
        figures.add(f"{at_40}, {name}: time", seconds / 60, "min")
    for name, run in extrapolated["runs"].items():
        if run.get("derived"):
            continue  # named below, among the seed's runs, with how it was derived
        figures.add(f"{at_40}, {name}: time", run["seconds"] / 60, "min")
        figures.add(f"{at_40}, {name}: time per layer", run["seconds_per_layer"], "s")
        figures.add(f"{at_40}, {name}: peak RSS", run["peak_rss"] / 1e9, "GB")
        figures.add(f"{at_40}, {name}: fits this machine's memory", run["fits_machine"])
    for name, what in SEED_RUNS.items():
        run = extrapolated["runs"].get(name)
        if run is None:
            continue
        what = f"{what} ({run['derived']})" if run.get("derived") else what
        figures.add(f"{at_40}, {what}: time", run["seconds"] / 60, "min", goal=SEED_GOALS.get(name))
        figures.add(f"{at_40}, {what}: peak RSS", run["peak_rss"] / 1e9, "GB")
        for side, f in run.get("decoding_forward", {}).items():
            figures.add(f"{at_40}, {what}: {side} time per decoding forward", f["seconds"], "s")
            figures.add(f"{at_40}, {what}: {side} bytes read per decoding forward", f["bytes"] / 1e9, "GB")
        if "decoding_seconds" in run:
            for side, seconds in run["decoding_seconds"].items():
                figures.add(f"{at_40}, {what}: {side} decoding, whole prompt sets", seconds / 60, "min")
            figures.add(f"{at_40}, {what}: what does not decode", undecoded_seconds(run) / 60, "min")
        if "integer_execution" in run:
            i = run["integer_execution"]
            figures.add(f"{at_40}, {what}: integer execution (intref)", i["seconds"] / 60, "min")
            figures.add(
                f"{at_40}, {what}: integer execution's set-up and layer reads (what riding the candidate's "
                "pass would save at most)",
                i["shared_pass_saves_at_most"] / 60,
                "min",
            )
            if "shared_pass_saves_at_most_from_disk" in i:
                figures.add(
                    f"{at_40}, {what}: the same, its layers read from the disk (at most)",
                    i["shared_pass_saves_at_most_from_disk"] / 60,
                    "min",
                )
    for name, run in doc["runs"].items():
        for side, d in (run.get("decoding") or {}).items():
            figures.add(f"{name}, {side}: decoding forwards", d["forwards"])
            figures.add(f"{name}, {side}: seconds per decoding forward", d["seconds_per_forward"], "s")
            figures.add(
                f"{name}, {side}: bytes read per decoding forward", d["bytes_per_forward"] / 1e9, "GB"
            )
            figures.add(
                f"{name}, {side}: bytes read per decoding forward / its decoder layers' bytes",
                d["bytes_per_forward"] / d["layers_bytes"],
            )
    for what, v in extrapolated["validations"].items():
        runs = ", ".join(f"{task}: {run}" for task, run in v["runs"].items()) or "none measured"
        figures.add(f"{at_40}, {what} validation: runs", runs)
        if v["runs"]:
            figures.add(f"{at_40}, {what} validation: time", v["seconds"] / 60, "min")
            figures.add(f"{at_40}, {what} validation: peak RSS", v["peak_rss"] / 1e9, "GB")
            figures.add(f"{at_40}, {what} validation: fits this machine's memory", v["fits_machine"])
        if v["floor_seconds"] is not None:
            what_floor = f"{at_40}, {what} validation: bare streamed forward of both sides"
            figures.add(what_floor, v["floor_seconds"] / 60, "min")
        if v["missing"]:
            figures.add(f"{at_40}, {what} validation: not measured", ", ".join(v["missing"]))
    for task, t in extrapolated.get("serving", {}).get("tasks", {}).items():
        figures.add(f"{at_40}, {task} streamed: decoding forwards a side (at most)", t["forwards"])
        if "skipped" in t:
            figures.add(f"{at_40}, {task}: skipped on this model", t["skipped"])
            continue
        for side, f in t["sides"].items():
            what = f"{at_40}, {task} streamed, {side}"
            figures.add(f"{what}: decoding time on this machine", f["seconds"] / 3600, "h")
            figures.add(f"{what}: bytes read decoding", f["bytes_read"] / 1e12, "TB")
        figures.add(f"{at_40}, {task} streamed: resident while decoding", t["resident_bytes"] / 1e9, "GB")
        figures.add(f"{at_40}, {task} streamed: fits a 24 GB GPU", t["fits_gpu_24gb"])


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layers", type=int, default=DEFAULT_WIDE_LAYERS, choices=(4, 8))
    parser.add_argument(
        "--runs", help="comma-separated run names (default: all): " + ", ".join([*RUNS, *BARE])
    )
    parser.add_argument("--fixtures", type=Path, default=TEST_FIXTURES)
    parser.add_argument(
        "--rounds", type=int, default=1, help="measure each run this many times, alternating the order"
    )
    parser.add_argument(
        "--no-measure",
        action="store_true",
        help="measure nothing: the figures again from the latest JSON's runs (after a change to how they are "
        "derived); each run keeps its own commit",
    )
    parser.add_argument(
        "--prompts",
        type=int,
        help="run smoke on its first N prompts (one decoding batch is enough to measure a forward's cost); "
        "the extrapolation scales the decoding to the whole sets' forwards",
    )
    parser.add_argument(
        "--cases", type=int, help="with --prompts: vision's first N cases (default N of --prompts)"
    )
    parser.add_argument("--bare", type=Path, help=argparse.SUPPRESS)  # the child of a bare forward
    add_arguments(parser)
    options = parser.parse_args()
    if options.bare is not None:
        tune_allocator()  # glibc's thresholds as the command line sets them, measured as it runs
        print(json.dumps(bare_streamed_forward(options.bare)))
        return 0

    if options.quick:
        names = {"ref": TINY_BF16, "w4a8": TINY_W4A8, "exl3": TINY_EXL3}
        wanted = list(QUICK_RUNS)
    else:
        bf16, w4a8, exl3 = wide_names(options.layers)
        names = {"ref": bf16, "w4a8": w4a8, "exl3": exl3}
        wanted = [*RUNS, *BARE]
    if options.rounds < 1:
        parser.error(f"--rounds must be at least 1, not {options.rounds}")
    if options.no_measure:
        wanted = []
    elif options.runs:
        wanted = [r.strip() for r in options.runs.split(",") if r.strip()]
        unknown = [r for r in wanted if r not in RUNS and r not in BARE]
        if unknown:
            parser.error(f"unknown runs {unknown}; choose from {[*RUNS, *BARE]}")
    needed = {"ref"} | {RUNS[r].candidate for r in wanted if r in RUNS}
    needed |= {r.removeprefix("bare-") for r in wanted if r in BARE}
    fixtures = TEST_FIXTURES if options.quick else options.fixtures
    folders: dict[str, Path] = {}
    if not options.no_measure:
        built = build_fixtures(fixtures, [names[s] for s in sorted(needed)], progress=print)
        folders = {side: built[names[side]] for side in needed}
    for folder in folders.values():  # digests cached: every run starts alike, none pays the first hashing
        Checkpoint.open(folder).content_sha256(DigestCache.default())

    deeper = not options.quick and options.layers != DEFAULT_WIDE_LAYERS
    bench = f"real_shape_{options.layers}l" if deeper else "real_shape"
    earlier = latest(bench, options.results, options.quick)
    doc: dict[str, Any] = {}
    if earlier is not None and earlier.get("data", {}).get("fixtures", {}).get("ref") == names["ref"]:
        doc = earlier["data"]
    if options.no_measure and not doc.get("runs"):
        parser.error(f"--no-measure derives the figures from the latest {bench} JSON, and there is none")
    commit, dirty = git_commit()
    doc.update(
        {
            "layers": 2 if options.quick else options.layers,
            "fixtures": names,
            "corpus": CORPUS,
            "memory_bytes": bench_machine()["memory_bytes"],
        }
    )
    doc.setdefault("runs", {})
    doc.setdefault("bare", {})
    if deeper:
        # The streamed peak should not grow with depth: the 8-layer run is read against the 4-layer one.
        shallow = latest("real_shape", options.results, quick=False)
        shallow_run = (shallow or {}).get("data", {}).get("runs", {}).get("ppl-moe-layers-streamed")
        if shallow_run is not None:
            doc["shallower"] = {
                "layers": shallow["data"]["layers"],
                "streamed_peak_rss": shallow_run["peak_rss"],
                "commit": shallow_run.get("commit"),
            }
    doc["bytes"] = {**doc.get("bytes", {}), **{side: unit_bytes(f) for side, f in folders.items()}}
    # What a decoding's caches grow with (`cache_growth`): the text model's widths and smoke's batch. Without
    # a measurement (--no-measure) the fixtures need not be built: the document's own are kept.
    if "ref" in folders:
        doc["text_config"] = Checkpoint.open(folders["ref"]).config.get("text_config", {})
    if "ref" in folders or "chat_template_thinking" not in doc:
        # The serving tasks' forwards depend on the model's template and on whether it can draft at all. The
        # tiny MiniCPM-V is the same architecture, with the template the fixtures share.
        source = folders.get("ref") or build_fixtures(TEST_FIXTURES, [TINY_BF16], progress=print)[TINY_BF16]
        doc.update(serving_facts(source))
    doc["decoding_batch"] = load_spec(SmokeSpec, default_spec_path("smoke")).generation.batch
    # The floor's rates, measured in this call, next to its runs (a --no-measure call measures them now and
    # says when: the runs it reads them against were measured earlier).
    window = 512
    doc["floor_rates"] = {
        **machine_rates(doc.get("text_config") or {}, doc["decoding_batch"], window),
        "measured": "with the runs"
        if wanted
        else f"at {time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC, after the runs",
    }
    # The kept runs' cut stays theirs: re-derived figures (--no-measure), or runs that do not decode (bare
    # forwards, tensors) measured beside them. A decoding run measured again sets its own (or none).
    decoding = any(r in RUNS and {"smoke", "vision"} & set(RUNS[r].tasks.split(",")) for r in wanted)
    if not options.no_measure and decoding:
        doc.pop("decoding_scale", None)
        doc.pop("decoding_subset", None)
    if options.prompts:
        subset_root = Path(tempfile.mkdtemp(prefix="evalsuite-bench-subset-"))
        cases = options.prompts if options.cases is None else options.cases
        SUBSET_SPECS.update(subset_specs(subset_root, options.prompts, cases))
        full, cut = decoding_forwards(folders["ref"], {}), decoding_forwards(folders["ref"], SUBSET_SPECS)
        doc["decoding_scale"] = {side: full[side] / cut[side] for side in full}
        doc["decoding_subset"] = {
            "prompts": options.prompts,
            "cases": cases,
            "forwards": cut,
            "whole_forwards": full,
        }
    with recorded(bench, __doc__, options) as figures:
        figures.data = doc
        stamp = f"{commit}{'+dirty' if dirty else ''}"
        code = measure_runs(doc, wanted, folders, stamp, figures, options.rounds)
        summarise(doc)
        report(doc)
        add_figures(doc, figures)
    return code


def subset_specs(folder: Path, prompts: int, cases: int) -> dict[str, Path]:
    """smoke's shipped spec with its first `prompts` prompts and vision's with its first `cases` cases (its
    single image kept), each written into `folder`: the same tables and settings, fewer decodings."""
    out = {}
    for task, block, count in (("smoke", "\n[[prompts]]", prompts), ("vision", "\n[[cases]]", cases)):
        head, *items = default_spec_path(task).read_text(encoding="utf-8").split(block)
        path = folder / f"{task}-first-{count}.toml"
        path.write_text(head + "".join(block + item for item in items[:count]), encoding="utf-8")
        out[task] = path
    return out


def decoding_forwards(ref: Path, specs: dict[str, Path]) -> dict[str, int]:
    """The forwards each side's greedy decoding takes under these specs (else the shipped ones), by side, as a
    streamed side decodes: per smoke batch (the spec's batches, by budget, the same on both sides) its
    longest `max_new_tokens` (the random wide pair never stops early), per vision case its own and the single
    image's (each decoded alone)."""
    from evalsuite.observers.greedy_answers import batches
    from evalsuite.protocol.side import open_side
    from evalsuite.tasks.smoke import prompt_ids
    from evalsuite.tasks.vision import VisionSpec

    smoke = load_spec(SmokeSpec, specs.get("smoke", default_spec_path("smoke")))
    side = open_side("ref", str(ref), BackendOptions())
    prompts = [{"ids": prompt_ids(side, p), "max_new_tokens": p.max_new_tokens} for p in smoke.prompts]
    vision = load_spec(VisionSpec, specs.get("vision", default_spec_path("vision")))
    own = vision.generation.max_new_tokens  # the single image, then each case
    cases = own + sum(case.max_new_tokens or own for case in vision.cases)
    return {
        side: cases
        + sum(
            max(prompts[i]["max_new_tokens"] for i in members)
            for members in batches(prompts, smoke.generation.batch, by_budget=True)
        )
        for side in ("ref", "ckpt")
    }


def measure_one(name: str, folders: dict[str, Path], commit: str, tmp: Path) -> dict[str, Any] | None:
    """One run (a task run or a bare forward) from a cold page cache: its figures, or None when it could not
    be done."""
    evict_page_cache(list(folders.values()))
    if name in BARE:
        side = name.removeprefix("bare-")
        result = measured([sys.executable, __file__, "--bare", str(folders[side])])
        if result["exit"] != 0:
            return None
        figures_of_run = json.loads(result["stdout"].strip().splitlines()[-1])
        entry = {**figures_of_run, "wall_seconds": result["seconds"], "commit": commit}
        return entry | {k: result[k] for k in ("peak_rss", "load_average")}
    spec = RUNS[name]
    run_out = tmp / name
    recording = tmp / "record-ref" / RECORDING
    if spec.kind == "replay" and not recording.is_dir():
        print("  (recording the reference first: record-ref)", file=sys.stderr, flush=True)
        if measure_one("record-ref", folders, commit, tmp) is None:
            return None
        evict_page_cache(list(folders.values()))
    if spec.kind == "record":
        run_out.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(recording, ignore_errors=True)
        run_out = recording
    args = spec.args(folders["ref"], folders[spec.candidate], run_out, recording)
    result = measured([sys.executable, "-m", "evalsuite.cli", *args])
    if result["exit"] not in (0, 1):
        return None
    common = {
        "tasks": spec.tasks,
        "kind": spec.kind,
        "streamed": spec.streamed,
        "exit": result["exit"],
        "seconds": result["seconds"],
        "peak_rss": result["peak_rss"],
        "load_average": result["load_average"],
        "commit": commit,
    }
    if spec.kind == "record":
        return {**common, "recording_bytes": sum(p.stat().st_size for p in run_out.rglob("*") if p.is_file())}
    results = json.loads((run_out / "results.json").read_text())
    return {
        **common,
        "statuses": {task: entry["status"] for task, entry in results["tasks"].items()},
        "layer_loads": layer_loads(results),
        "decoding": decoding(results),
        "loads": load_figures(results),
        **fed_share(results),
    }


def decoding(results: dict[str, Any]) -> dict[str, Any]:
    """Per side, what decoding cost in the run: its forwards (one per new token for a batch of prompts, each
    reading every decoder layer), their wall seconds (the observations that decode: answers),
    the bytes read per forward (routed experts only), and a whole decoder layer's bytes for scale."""
    out = {}
    for entry in results.get("model_loads", []):
        forwards = entry.get("generation_forwards") or 0
        if not forwards:
            continue
        seconds = sum(v for name, v in entry.get("seconds", {}).items() if name.endswith("answers"))
        out[entry["side"]] = {
            "forwards": forwards,
            "seconds": seconds,
            "side_seconds": sum(entry.get("seconds", {}).values()),
            "seconds_per_forward": seconds / forwards,
            "bytes_per_forward": entry["generation_bytes"] / forwards,
            "layers_bytes": entry["decoder_layers_bytes"],
            "n_layers": entry["n_layers"],
        }
    return out


def load_figures(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Per model the run loaded: its side and execution, its set-up seconds, its observations' seconds and,
    streamed, how many of those seconds read its decoder layers from the files (`results.json`'s
    `model_loads`)."""
    return [
        {
            "side": entry["side"],
            "backend": entry["backend"],
            "load_seconds": entry.get("load_seconds"),
            "seconds": sum(entry.get("seconds", {}).values()),
            "layer_read_seconds": entry.get("layer_read_seconds"),
        }
        for entry in results.get("model_loads", [])
    ]


def measured_load(run: dict[str, Any], side: str, backend: str) -> dict[str, Any] | None:
    """The run's load of `side` by `backend` (`load_figures`) whose layer reads were measured, else None."""
    return next(
        (
            x
            for x in run.get("loads", [])
            if (x["side"], x["backend"]) == (side, backend) and x.get("layer_read_seconds") is not None
        ),
        None,
    )


def integer_execution(
    run: dict[str, Any], layers_40: float, cold: dict[str, Any] | None
) -> dict[str, float] | None:
    """A run's integer execution of the candidate (its `intref` load) at 40 layers: its set-up and its reads
    of the decoder layers (grown as the candidate's layer bytes do) are what it would not pay were it to ride
    the candidate's `hf` pass, which reads the same files; its whole time beside them. None when the run
    has no such load with its reads measured.

    It runs after that pass, so on the wide pair its reads find the files in the page cache; at 40 layers
    the candidate's files outgrow what the cache keeps beside the run, and they would come from the disk.
    Bounded from above, then, by the `hf` pass's own reads of the same layers from a cold cache (`cold`: the
    `ppl,moe,layers` run, whose passes start cold; its reads include the decompression `intref` skips)."""
    load = measured_load(run, "ckpt", "intref")
    if load is None:
        return None
    reads = load["layer_read_seconds"] * layers_40
    rest = load["seconds"] - load["layer_read_seconds"]
    out = {
        "set_up_seconds": load["load_seconds"],
        "layer_read_seconds": reads,
        # Its forwards, head and scoring: every layer's forward grows with depth as its bytes do.
        "seconds": load["load_seconds"] + reads + rest * layers_40,
        "shared_pass_saves_at_most": load["load_seconds"] + reads,
    }
    cold_load = measured_load(cold or {}, "ckpt", "hf")
    if cold_load is not None:
        from_disk = cold_load["layer_read_seconds"] * layers_40
        out["layer_read_seconds_from_disk_at_most"] = from_disk
        out["shared_pass_saves_at_most_from_disk"] = load["load_seconds"] + max(reads, from_disk)
    return out


def fed_share(results: dict[str, Any]) -> dict[str, float]:
    """The share of the windows `moe` fed the candidate's layers the reference's input (its spec's `[fed]`),
    where the run has `moe`."""
    metrics = results["tasks"].get("moe", {}).get("metrics", {})
    if not metrics.get("n_tokens") or metrics.get("n_fed_tokens") is None:
        return {}
    return {"fed_share": metrics["n_fed_tokens"] / metrics["n_tokens"]}


def combined(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """A run's rounds as one: the median seconds (each layer's too, for a bare forward), every round's seconds
    kept, the largest peak, the load average at the first start and the last end."""
    entry = dict(rounds[-1])
    entry["seconds"] = statistics.median(r["seconds"] for r in rounds)
    entry["seconds_rounds"] = [r["seconds"] for r in rounds]
    entry["peak_rss"] = max(r["peak_rss"] for r in rounds)
    entry["load_average"] = [rounds[0]["load_average"][0], rounds[-1]["load_average"][1]]
    if "layer_seconds" in entry:
        per_layer = zip(*(r["layer_seconds"] for r in rounds), strict=True)
        entry["layer_seconds"] = [statistics.median(values) for values in per_layer]
    return entry


def measure_runs(
    doc: dict[str, Any],
    wanted: list[str],
    folders: dict[str, Path],
    commit: str,
    figures: Figures,
    rounds: int = 1,
) -> int:
    """Each wanted run into `doc` (its progress on stderr), `rounds` times, in the listed order and then in
    reverse (A B C, C B A, ...: a drift of the machine's speed falls on both sides of a ratio), each from a
    cold page cache; the JSON rewritten after each: 2 when a run could not be done, else 0."""
    done: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="evalsuite-bench-real-shape-") as tmp:
        for round_index in range(rounds):
            for name in wanted if round_index % 2 == 0 else wanted[::-1]:
                print(f"{name} (round {round_index + 1} of {rounds}) ...", file=sys.stderr, flush=True)
                entry = measure_one(name, folders, commit, Path(tmp))
                if entry is None:
                    return 2
                done.setdefault(name, []).append(entry)
                doc["bare" if name in BARE else "runs"][name] = combined(done[name])
                summarise(doc)
                add_figures(doc, figures)
                figures.save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
