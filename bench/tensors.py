"""Benchmark of the `tensors` task on a generated checkpoint pair of at least 2 GB: throughput, peak memory.

Builds, in a temporary folder removed afterwards, a Llama-shaped BF16 source (random weights, several shards
and an index) and its W4A8 compressed-tensors copy (INT4 MLP, INT8 attention, BF16 embeddings and head: the
fixtures' writer), then prints ratios measured in this one run (these machines are noisy; compare ratios):
  throughput  bytes of both checkpoints per second through the task (a whole `evalsuite run --tasks tensors`
              in a child process, timed around the run, imports excluded) over the same for reading and
              hashing every shard of both with hashlib.sha256 in one pass (goal >= 0.8);
  memory      peak resident memory of the task's child process, and that peak above its footprint once
              everything is imported (goal <= 2 × the largest tensor + 300 MB).
Each figure is the best of `--repeats` runs, with the files in the page cache (read once before).

    python bench/tensors.py [--layers 11] [--repeats 2] [--tmp DIR]
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
from safetensors.torch import save_file

from evalsuite.fixtures import QuantGroup, QuantPolicy, write_w4a8_copy

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
from evalsuite.runner import RunRequest, run
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
entry = result.results["tasks"]["tensors"]
print(json.dumps({"seconds": seconds, "cpu": cpu, "peak": peak, "before": before, "status": entry["status"],
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


def child(code: str, *args: object) -> dict:
    proc = subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"benchmark child failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=11, help="decoder layers (11 gives a 2.4 GB pair)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--tmp", type=Path, default=None, help="where the pair is generated (then removed)")
    args = parser.parse_args()
    mb = 1 << 20
    with tempfile.TemporaryDirectory(prefix="evalsuite-bench-tensors-", dir=args.tmp) as tmp:
        root = Path(tmp)
        started = time.perf_counter()
        largest = write_source(root / "bf16", args.layers)
        write_w4a8_copy(root / "bf16", root / "w4a8", POLICY)
        shards = sorted((root / "bf16").glob("*.safetensors")) + sorted((root / "w4a8").glob("*.safetensors"))
        total = sum(p.stat().st_size for p in shards)
        built = time.perf_counter() - started
        print(f"pair: {total / 1e9:.2f} GB in {len(shards)} shards (built in {built:.0f} s)")
        print(f"largest tensor: {largest / mb:.0f} MB")
        child(HASH_CHILD, *shards)  # the page cache now holds both checkpoints
        hashing, task = [], []
        for i in range(args.repeats):
            hashing.append(child(HASH_CHILD, *shards))
            task.append(child(TASK_CHILD, root / "w4a8", root / "bf16", root / f"run{i}"))
        best_hash = min(h["seconds"] for h in hashing)
        best = min(task, key=lambda t: t["seconds"])
        peak = min(t["peak"] for t in task)
        above = min(t["peak"] - t["before"] for t in task)
        goal = 2 * largest + 300 * mb
        m = best["metrics"]
        print(
            f"task: {best['status']}, {m['source_tensors']} source tensors, {m['quantized_int4']} INT4, "
            f"{m['quantized_int8']} INT8, {m['protected_identical']}/{m['protected_total']} intact, "
            f"decode_exact {m['decode_exact']}, worst_rel_err {m['worst_rel_err']:.4f}"
        )
        print(f"hashlib.sha256, one pass: {best_hash:.2f} s = {total / best_hash / 1e9:.2f} GB/s")
        print(f"tensors task:             {best['seconds']:.2f} s = {total / best['seconds'] / 1e9:.2f} GB/s")
        print(f"throughput ratio: {best_hash / best['seconds']:.2f} (goal >= 0.8)")
        hash_cpu, task_cpu = min(h["cpu"] for h in hashing), min(t["cpu"] for t in task)
        print(
            f"CPU time (all threads): hashing {hash_cpu:.2f} s, task {task_cpu:.2f} s: the task does "
            f"{hash_cpu / task_cpu:.2f} of hashing's work per CPU second (load average now "
            f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs)"
        )
        print(
            f"peak RSS: {peak / mb:.0f} MB, {above / mb:.0f} MB above the imported footprint "
            f"(goal <= 2 x {largest / mb:.0f} + 300 = {goal / mb:.0f} MB)"
        )


if __name__ == "__main__":
    main()
