"""Benchmark of the `tensors` task on a checkpoint pair of at least 2 GB: throughput, peak memory, per format.

Takes a BF16 source (`--source`, e.g. the 3 GB MiniCPM-V fixture `minicpmv47-3gb-bf16`; by default a
Llama-shaped one of random weights generated in a temporary folder removed afterwards) and writes, there too,
one compressed-tensors copy per `--packs` entry with compressed-tensors' own compressors: `int` (the fixtures'
W4A8 writer: INT4 and INT8 per channel), `fp8` (FP8 E4M3 per channel, `float-quantized`, as llm-compressor's
FP8_DYNAMIC) and `nvfp4` (FP4 in groups of 16 under a global scale, `nvfp4-pack-quantized`, as NVFP4A16).
Then, for each pack, it prints ratios measured in this one run (these machines are noisy; compare ratios):
  throughput  bytes of both checkpoints per second through the task (a whole `evalsuite run --tasks tensors`
              in a child process, timed around the run, imports excluded) over the same for reading and
              hashing every shard of both with hashlib.sha256 in one pass (goal >= 0.8);
  memory      peak resident memory of the task's child process, and that peak above its footprint once
              everything is imported (goal <= 2 × the largest tensor + 300 MB); where the task forks its
              workers, the largest worker's peak above the same footprint, and the sum for the task and two
              workers (what the goal is held to then).
Each figure is the best of `--repeats` runs, with the files in the page cache (read once before).

    python bench/tensors.py [--source DIR] [--packs int,fp8,nvfp4] [--layers 11] [--repeats 2] [--tmp DIR]
                            [--quick] [--results DIR]

`--quick` takes the test suite's tiny MiniCPM-V 4.7 BF16 fixture as the source, the `int` pack, one repeat
(seconds; checks the bench, its figures say nothing). The figures go to bench/results/ as JSON
(bench/figures.py).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from figures import TEST_FIXTURES, Figures, add_arguments, recorded
from safetensors.torch import save_file

from evalsuite.fixtures import (
    TINY_BF16,
    TINY_W4A8_POLICY,
    QuantGroup,
    QuantPolicy,
    build_fixtures,
    write_w4a8_copy,
)

HIDDEN, INTERMEDIATE, VOCAB, HEADS, KV_HEADS = 2048, 8192, 32768, 16, 4
POLICY = QuantPolicy(
    groups=(
        QuantGroup("int4_mlp", (r"re:model\.layers\.\d+\.mlp\.(gate|up|down)_proj$",), bits=4),
        QuantGroup("int8_attention", (r"re:model\.layers\.\d+\.self_attn\.(q|k|v|o)_proj$",), bits=8),
    ),
    ignore=("lm_head",),
)

HASH_CHILD = r"""
import hashlib, json, sys, time
files = sys.argv[1:]
start, cpu = time.perf_counter(), time.process_time()
for path in files:
    digest = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        while block := f.read(16 << 20):
            digest.update(block)
print(json.dumps({"seconds": time.perf_counter() - start, "cpu": time.process_time() - cpu}))
"""

TASK_CHILD = r"""
import json, sys, time
from pathlib import Path
import psutil
# What the run imports on first use, imported before the clock and the baseline footprint start.
import compressed_tensors.compressors, compressed_tensors.quantization, compressed_tensors.utils.match
import matplotlib.figure
import evalsuite.formats.compressed_tensors, evalsuite.tasks
from evalsuite.pipeline.registry import registered_tasks
from evalsuite.pipeline.runner import RunRequest, run
registered_tasks()  # imports every task plugin, as the run's plan does first
def high_water_mark():
    # VmHWM belongs to this process image; ru_maxrss would carry over the parent's peak across fork + exec.
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))
ckpt, ref, out = sys.argv[1:4]
before = psutil.Process().memory_info().rss
start, cpu = time.perf_counter(), time.process_time()
result = run(RunRequest(ckpt=ckpt, ref=ref, tasks=["tensors"], out=Path(out), resume=False))
seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
peak = high_water_mark()
# The task's forked workers, once the pool has reaped them: the largest one's peak, and their CPU time.
import resource
children = resource.getrusage(resource.RUSAGE_CHILDREN)
entry = result.results["tasks"]["tensors"]
print(json.dumps({"seconds": seconds, "cpu": cpu + children.ru_utime + children.ru_stime, "peak": peak,
                  "before": before, "worker_peak": children.ru_maxrss * 1024, "status": entry["status"],
                  "metrics": entry["metrics"]}))
"""


def write_source(folder: Path, layers: int) -> int:
    """A Llama-shaped BF16 checkpoint of random weights, one shard per two layers; returns the size of its
    largest tensor in bytes."""
    folder.mkdir(parents=True)
    gen = torch.Generator().manual_seed(0)
    head_dim = HIDDEN // HEADS

    def weight(rows: int, cols: int) -> torch.Tensor:
        return (torch.randn(rows, cols, generator=gen) * cols**-0.5).to(torch.bfloat16)

    shards: list[dict[str, torch.Tensor]] = [
        {
            "model.embed_tokens.weight": weight(VOCAB, HIDDEN),
            "model.norm.weight": torch.ones(HIDDEN).bfloat16(),
        }
    ]
    for i in range(layers):
        if i % 2 == 0:
            shards.append({})
        p = f"model.layers.{i}"
        shards[-1].update(
            {
                f"{p}.input_layernorm.weight": torch.ones(HIDDEN, dtype=torch.bfloat16),
                f"{p}.post_attention_layernorm.weight": torch.ones(HIDDEN, dtype=torch.bfloat16),
                f"{p}.self_attn.q_proj.weight": weight(HIDDEN, HIDDEN),
                f"{p}.self_attn.k_proj.weight": weight(KV_HEADS * head_dim, HIDDEN),
                f"{p}.self_attn.v_proj.weight": weight(KV_HEADS * head_dim, HIDDEN),
                f"{p}.self_attn.o_proj.weight": weight(HIDDEN, HIDDEN),
                f"{p}.mlp.gate_proj.weight": weight(INTERMEDIATE, HIDDEN),
                f"{p}.mlp.up_proj.weight": weight(INTERMEDIATE, HIDDEN),
                f"{p}.mlp.down_proj.weight": weight(HIDDEN, INTERMEDIATE),
            }
        )
    shards.append({"lm_head.weight": weight(VOCAB, HIDDEN)})
    weight_map, total, largest = {}, 0, 0
    for n, tensors in enumerate(shards, 1):
        name = f"model-{n:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, str(folder / name), metadata={"format": "pt"})
        for key, tensor in tensors.items():
            weight_map[key] = name
            size = tensor.numel() * tensor.element_size()
            total, largest = total + size, max(largest, size)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": layers,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "vocab_size": VOCAB,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return largest


FLOAT_SCHEMES = {
    "fp8": (
        "float-quantized",
        {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel"},
        {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token", "dynamic": True},
    ),
    "nvfp4": (
        "nvfp4-pack-quantized",
        {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "tensor_group", "group_size": 16},
        None,
    ),
}
FP8_MAX, FP4_MAX = 448.0, 6.0


def _float_compressed(weight: torch.Tensor, kind: str, scheme) -> dict[str, torch.Tensor]:
    """One weight through compressed-tensors' compressor: FP8 per channel or NVFP4, scales by absmax."""
    from compressed_tensors.compressors import BaseCompressor

    fmt = FLOAT_SCHEMES[kind][0]
    w = weight.float()
    tiny = torch.finfo(torch.float32).tiny
    if kind == "fp8":
        state = {
            "weight": weight,
            "weight_scale": (w.abs().amax(1, keepdim=True) / FP8_MAX).clamp(min=tiny).bfloat16(),
        }
    else:
        global_scale = (FP8_MAX * FP4_MAX / w.abs().amax().clamp(min=tiny)).reshape(1)
        group_amax = w.reshape(w.shape[0], -1, 16).abs().amax(-1)
        # The stored scale is FP8: round it there first, so that the codes are chosen against what decodes.
        scale = (group_amax / FP4_MAX * global_scale).to(torch.float8_e4m3fn).float().clamp(min=2.0**-9)
        state = {"weight": weight, "weight_scale": scale, "weight_global_scale": global_scale}
    compressed = BaseCompressor.get_value_from_registry(fmt).compress(state, scheme)
    return {key: value.contiguous() for key, value in compressed.items()}


def write_float_copy(src: Path, dst: Path, kind: str, policy: QuantPolicy) -> None:
    """A compressed-tensors FP8 or NVFP4 copy of `src`: the modules the int policy's targets cover, one shard
    at a time, every other tensor and file copied as it is."""
    import shutil

    import compressed_tensors
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme
    from safetensors import safe_open

    from evalsuite.formats.compressed_tensors import SchemeLookup

    fmt, weights, inputs = FLOAT_SCHEMES[kind]
    targets = [t for g in policy.groups for t in g.targets]
    scheme = QuantizationScheme(
        targets=targets,
        weights=QuantizationArgs(**weights),
        input_activations=QuantizationArgs(**inputs) if inputs else None,
        format=fmt,
    )
    config = QuantizationConfig(
        config_groups={"group_0": scheme},
        format=fmt,
        quantization_status="compressed",
        ignore=list(policy.ignore),
    )
    qc = {
        "version": compressed_tensors.__version__,
        "quant_method": "compressed-tensors",
        **config.model_dump(mode="json", exclude={"quant_method"}),
    }
    lookup = SchemeLookup(qc)
    dst.mkdir(parents=True)
    weight_map = {}
    for path in sorted(src.iterdir()):
        if path.suffix != ".safetensors":
            if path.is_file() and path.name not in ("config.json", "model.safetensors.index.json"):
                shutil.copyfile(path, dst / path.name)
            continue
        out: dict[str, torch.Tensor] = {}
        with safe_open(str(path), "pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open has no iteration of its own
                tensor = handle.get_tensor(name)
                module = name.removesuffix(".weight")
                if (
                    name.endswith(".weight")
                    and tensor.dim() == 2
                    and lookup.covering(module, "linear").scheme
                ):
                    out.update(
                        {f"{module}.{k}": v for k, v in _float_compressed(tensor, kind, scheme).items()}
                    )
                else:
                    out[name] = tensor
        save_file(out, str(dst / path.name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(out, path.name))
    total = sum(p.stat().st_size for p in dst.glob("*.safetensors"))
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    source_config = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**source_config, "quantization_config": qc}, indent=2))


def largest_tensor(folder: Path) -> int:
    """Bytes of the largest tensor of a checkpoint, from its headers."""
    from evalsuite.files.checkpoint import Checkpoint

    return max(info.nbytes for info in Checkpoint.open(folder).tensors.values())


def child(code: str, *args: object) -> dict:
    proc = subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"benchmark child failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", type=Path, default=None, help="a BF16 checkpoint (default: generated)")
    parser.add_argument("--packs", default="int,fp8,nvfp4", help="comma-separated: int, fp8, nvfp4")
    parser.add_argument("--layers", type=int, default=11, help="generated decoder layers (11: a 2.4 GB pair)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--tmp", type=Path, default=None, help="where packs are written (then removed)")
    add_arguments(parser)
    args = parser.parse_args()
    if args.quick:
        args.source = build_fixtures(TEST_FIXTURES, [TINY_BF16])[TINY_BF16]
        args.packs, args.repeats = "int", 1
    mb = 1 << 20
    with (
        recorded("tensors", __doc__, args) as figures,
        tempfile.TemporaryDirectory(prefix="evalsuite-bench-tensors-", dir=args.tmp) as tmp,
    ):
        root = Path(tmp)
        started = time.perf_counter()
        if args.source is None:
            source, policy = root / "bf16", POLICY
            write_source(source, args.layers)
        else:
            config = json.loads((args.source / "config.json").read_text())
            source = args.source
            policy = TINY_W4A8_POLICY if config.get("model_type") == "minicpmv4_7" else POLICY
        print(f"source: {source} ({'generated' if args.source is None else 'given'})")
        for kind in args.packs.split(","):
            pack = root / kind
            if kind == "int":
                write_w4a8_copy(source, pack, policy)
            else:
                write_float_copy(source, pack, kind, policy)
            measure(kind, source, pack, root, args.repeats, time.perf_counter() - started, mb, figures)
            started = time.perf_counter()


def measure(
    kind: str, source: Path, pack: Path, root: Path, repeats: int, built: float, mb: int, figures: Figures
) -> None:
    """Hash both checkpoints and run the task on them, `repeats` times each, and print the figures."""
    shards = sorted(source.glob("*.safetensors")) + sorted(pack.glob("*.safetensors"))
    total = sum(p.stat().st_size for p in shards)
    largest = max(largest_tensor(source), largest_tensor(pack))
    print(f"\n[{kind}] pair: {total / 1e9:.2f} GB in {len(shards)} shards (written in {built:.0f} s)")
    print(f"largest tensor: {largest / mb:.0f} MB")
    child(HASH_CHILD, *shards)  # the page cache now holds both checkpoints
    hashing, task = [], []
    for i in range(repeats):
        hashing.append(child(HASH_CHILD, *shards))
        task.append(child(TASK_CHILD, pack, source, root / f"run-{kind}-{i}"))
    best_hash = min(h["seconds"] for h in hashing)
    best = min(task, key=lambda t: t["seconds"])
    peak = min(t["peak"] for t in task)
    above = min(t["peak"] - t["before"] for t in task)
    worker_above = min(t["worker_peak"] - t["before"] for t in task)
    goal = 2 * largest + 300 * mb
    m = best["metrics"]
    print(
        f"task: {best['status']}, {m['source_tensors']} source tensors, {m['quantized_int4']} INT4, "
        f"{m['quantized_int8']} INT8, {m['quantized_other']} other, "
        f"{m['protected_identical']}/{m['protected_total']} intact, decode_exact {m['decode_exact']}, "
        f"worst_rel_err {m['worst_rel_err']:.4f}, bpw {m['avg_bits_per_weight']}"
    )
    print(f"hashlib.sha256, one pass: {best_hash:.2f} s = {total / best_hash / 1e9:.2f} GB/s")
    print(f"tensors task:             {best['seconds']:.2f} s = {total / best['seconds'] / 1e9:.2f} GB/s")
    print(f"[{kind}] throughput ratio: {best_hash / best['seconds']:.2f} (goal >= 0.8)")
    figures.add(f"[{kind}] pair", total / 1e9, "GB")
    figures.add(f"[{kind}] task status", best["status"])
    figures.add(f"[{kind}] hashlib.sha256", total / best_hash / 1e9, "GB/s")
    figures.add(f"[{kind}] tensors task", total / best["seconds"] / 1e9, "GB/s")
    figures.add(f"[{kind}] throughput ratio, task / sha256", best_hash / best["seconds"], goal=">= 0.8")
    hash_cpu, task_cpu = min(h["cpu"] for h in hashing), min(t["cpu"] for t in task)
    print(
        f"CPU time (all threads and forked workers): hashing {hash_cpu:.2f} s, task {task_cpu:.2f} s: "
        f"the task does {hash_cpu / task_cpu:.2f} of hashing's work per CPU second (load average now "
        f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs)"
    )
    print(
        f"peak RSS: {peak / mb:.0f} MB, {above / mb:.0f} MB above the imported footprint "
        f"(goal <= 2 x {largest / mb:.0f} + 300 = {goal / mb:.0f} MB)"
    )
    held = above + 2 * max(worker_above, 0)
    figures.add(
        f"[{kind}] memory above the imported footprint (task + 2 workers) / goal", held / goal, goal="<= 1"
    )
    if worker_above > 0:
        # A forked worker's RSS counts the pages it shares with the task's process too: above that
        # process's imported footprint is what the worker adds (its reader's buffers, its blocks).
        print(
            f"forked workers: the largest peaked {worker_above / mb:.0f} MB above the imported footprint "
            f"(each adds that at most; with the task's own: {(above + 2 * worker_above) / mb:.0f} MB for 2)"
        )


if __name__ == "__main__":
    main()
