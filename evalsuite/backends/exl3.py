"""Backend `exl3`: an EXL3 (exllamav3) pack, run by exllamav3 where it can run, else from its decoded weights.

Two paths, chosen from the side's options and what is installed (`exllamav3_path`), and named in
`describe()` (so in every observation's `execution`, and in `ppl`'s `ckpt_execution`):

- **exllamav3** (`--device cuda…` with the optional `exllamav3` package, extra `exl3`): exllamav3's own
  model (`Config.from_directory`, `Model.from_config`, `load`, `forward` to logits), the kernels a user of the
  pack runs. It answers window logits and greedy generation (one full forward per new token, no cache);
  it has no image path here, so the `vision` task skips.
- **decoded** (every other case, the only one on a CPU): the Transformers model of the source architecture,
  built from the pack's config.json on the meta device, with every EXL3 Linear replaced by its weight
  decoded on the CPU by `evalsuite.formats.exl3` (W_hat bit-exact to exllamav3's reconstruction, the
  Hadamard rotations in float32, then cast to the run's dtype) and every other tensor loaded as stored.
  MoE experts, stored per expert, fill Transformers' fused 3-D expert tensors. One Linear is decoded at a
  time; the model itself is the only thing of model size in memory. Everything Transformers runs (norms,
  attention, the recurrence, routing, the vision tower) runs as for the source, so every primitive of the
  `hf` backend (window logits, generation, image features, hidden states) runs unchanged.

What the files must hold is decided before anything loads (`check_exl3_load_plan`): every tensor the model
needs is stored dense or as an EXL3 Linear whose trellis and sign vectors have the Linear's padded shape,
with a known codebook marker and a K in 1..8, nothing is stored that the model lacks, and
`quantization_config.json`'s `tensor_storage`, where present, agrees with the files.
"""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from evalsuite.backends.hf import (
    DTYPES,
    Generation,
    HFBackend,
    first_line,
    meta_model,
    package_version,
    transformers_config,
)
from evalsuite.backends.options import BackendOptions
from evalsuite.backends.skeleton import (
    fill_slot,
    fused_experts,
    ignored_on_load,
    named_tensors,
    refuse_mismatch,
    set_generation_config,
    tensor_slots,
    tie_weights,
)
from evalsuite.errors import DependencyError, InputError
from evalsuite.files.checkpoint import EXL3_CONFIG_FILE, Checkpoint
from evalsuite.formats import one_torch_thread
from evalsuite.formats.exl3 import (
    Exl3,
    codebook,
    decode_linear,
    exl3_linears,
    linear_problems,
    storage_problems,
    stored_bits,
)

EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def exllamav3_path(options: BackendOptions) -> bool:
    """Whether `exl3` runs a side through exllamav3 (a CUDA device and the package installed) rather than
    from its decoded weights. Decided without importing exllamav3, which compiles its CUDA extension."""
    return options.device != "cpu" and importlib.util.find_spec("exllamav3") is not None


@dataclass(frozen=True)
class ExpertPiece:
    """One expert's projection inside Transformers' fused experts tensor: `slot` (gate_up_proj or
    down_proj) of `experts`, expert `index`, rows `rows` of that expert's matrix."""

    experts: str
    slot: str
    index: int
    rows: slice
    shape: tuple[int, int]


class DecodedSkeleton:
    """The pack's model as Transformers builds it from config.json, on the meta device, and where each
    stored tensor goes: into a parameter by name, into a Linear's weight after decoding, or into one expert of
    a fused experts tensor. Nothing is read but headers and the 4-byte codebook markers until `load`."""

    def __init__(self, checkpoint: Checkpoint, options: BackendOptions) -> None:
        self.checkpoint = checkpoint
        self.dtype = DTYPES[options.dtype]
        self.config, _ = transformers_config(checkpoint, options)
        self.model = self._build()
        self.slots = tensor_slots(self.model)
        self.linears = exl3_linears(checkpoint.tensors)
        self.experts = {name: m for name, m in self.model.named_modules() if fused_experts(m)}
        self.decoded: dict[str, str | ExpertPiece] = {}  # EXL3 module -> its weight's slot or piece
        self.dense: dict[str, str | ExpertPiece] = {}  # stored tensor -> its slot or piece
        self.problems: list[str] = []
        self.unexpected: list[str] = []
        self.ignored: list[str] = []
        self._place()

    def _build(self) -> nn.Module:
        """The model from its config, parameters on the meta device."""
        # The decoded weights replace whatever the quantization config would make Transformers build.
        return meta_model(self.config, self.dtype, self.checkpoint)

    def _expert_piece(self, weight: str) -> ExpertPiece | None:
        """The fused-experts place of a per-expert weight name `<experts>.<e>.<proj>.weight`, if any."""
        experts, index, proj = _split_expert(weight.removesuffix(".weight"))
        module = self.experts.get(experts) if experts is not None else None
        if module is None or proj not in EXPERT_PROJECTIONS or not 0 <= index < module.gate_up_proj.shape[0]:
            return None
        _, two_i, hidden = module.gate_up_proj.shape
        inter = two_i // 2
        if proj == "down_proj":
            return ExpertPiece(experts, "down_proj", index, slice(0, hidden), (hidden, inter))
        rows = slice(0, inter) if proj == "gate_proj" else slice(inter, two_i)  # gate first, as Transformers
        return ExpertPiece(experts, "gate_up_proj", index, rows, (inter, hidden))

    def _marker_value(self, info: Any) -> int | None:
        return int.from_bytes(self.checkpoint.read_bytes(info.name), "little") if info.nbytes == 4 else None

    def _place(self) -> None:
        """Where every stored tensor goes; what is missing, unexpected or unreadable."""
        claimed: set[str] = set()
        for module, stored in sorted(self.linears.items()):
            claimed.update(info.name for info in stored.values())
            slot = self.slots.get(f"{module}.weight")
            if slot is not None and slot[2].dim() == 2:
                target: str | ExpertPiece = f"{module}.weight"
                out_features, in_features = slot[2].shape
            else:
                piece = self._expert_piece(f"{module}.weight")
                if piece is None:
                    self.unexpected.extend(sorted(info.name for info in stored.values()))
                    continue
                target, (out_features, in_features) = piece, piece.shape
            found = linear_problems(stored, out_features, in_features, self._marker_value)
            self.problems += [f"{module}: {problem}" for problem in found]
            bias = stored.get("bias")
            if bias is not None:
                if f"{module}.bias" in self.slots:
                    self.dense[bias.name] = f"{module}.bias"
                else:
                    self.unexpected.append(bias.name)
            self.decoded[module] = target
        for name in self.checkpoint.tensors:
            if name in claimed:
                continue
            if name in self.slots:
                self.dense[name] = name
            elif (piece := self._expert_piece(name)) is not None:
                self.dense[name] = piece
            else:
                self.unexpected.append(name)
        # What Transformers itself drops on load (an MTP head the model class does not build) is left in the
        # files, counted, and verified by the tensors task like any tensor; anything else is refused.
        self.ignored = ignored_on_load(self.model, self.unexpected)
        self.unexpected = [name for name in self.unexpected if name not in set(self.ignored)]
        self.decoded = {
            module: target
            for module, target in self.decoded.items()
            if not any(info.name in self.ignored for info in self.linears[module].values())
        }

    def missing(self) -> list[str]:
        """Parameters and persistent buffers of the model that no stored tensor fills (a tied target whose
        source is stored is filled from it)."""
        filled = {t for t in [*self.decoded.values(), *self.dense.values()] if isinstance(t, str)}
        pieces: dict[tuple[str, str], set[tuple[int, str]]] = {}
        for target in [*self.decoded.values(), *self.dense.values()]:
            if isinstance(target, ExpertPiece):
                pieces.setdefault((target.experts, target.slot), set()).add((target.index, str(target.rows)))
        for (experts, slot), got in pieces.items():
            module = self.experts[experts]
            per_expert = 2 if slot == "gate_up_proj" else 1
            if len(got) == module.gate_up_proj.shape[0] * per_expert:
                filled.add(f"{experts}.{slot}")
        tied = getattr(self.model, "all_tied_weights_keys", None) or {}
        return sorted(n for n in self.slots if n not in filled and not (n in tied and tied[n] in filled))

    def refuse_problems(self) -> None:
        """InputError naming what makes the files unloadable; nothing when they load faithfully."""
        if self.problems:
            more = f" (and {len(self.problems) - 1} more problems)" if len(self.problems) > 1 else ""
            raise InputError(f"EXL3 Linear {self.problems[0]}{more}", self.checkpoint.path)
        refuse_mismatch(self.checkpoint, self.missing(), sorted(self.unexpected))

    def load(self, device: str) -> nn.Module:
        """Every decoded Linear and every stored tensor into the model, the generation config, the device."""
        self.refuse_problems()
        self.load_tensors(None)
        tie_weights(self.model)
        leftover = sorted(n for n, t in named_tensors(self.model) if t.is_meta)
        refuse_mismatch(self.checkpoint, leftover, [])
        set_generation_config(self.model, self.checkpoint)
        return self.model.to(device) if device != "cpu" else self.model

    def load_tensors(self, names: set[str] | None) -> None:
        """Decode and place the EXL3 Linears and dense tensors among `names` (every one when None): a fused
        experts tensor is placed once all of its experts are, so `names` must hold whole units (the whole
        model, or one decoder layer's tensors when streamed)."""
        plan = getattr(self.model, "_get_dtype_plan", None)
        keep_fp32 = list(plan(self.dtype)) if plan is not None else []
        fused: dict[str, torch.Tensor] = {}

        def place(target: str | ExpertPiece, value: torch.Tensor) -> None:
            if isinstance(target, ExpertPiece):
                name = f"{target.experts}.{target.slot}"
                if name not in fused:
                    fused[name] = torch.empty(self.slots[name][2].shape, dtype=self.dtype)
                fused[name][target.index, target.rows] = value
                return
            fp32 = any(re.search(rf"(^|\.){re.escape(k)}(\.|$)", target) for k in keep_fp32)
            placeholder = self.slots[target][2]
            if target.endswith(".bias") and value.shape[0] != placeholder.shape[0]:
                value = value[: placeholder.shape[0]]  # exllamav3 stores a Linear's bias padded
            if value.is_floating_point():
                value = value.to(torch.float32 if fp32 else self.dtype)
            fill_slot(self.slots, target, value, self.checkpoint)

        def wanted(name: str) -> bool:
            return names is None or name in names

        with one_torch_thread():
            for module, target in self.decoded.items():
                infos = self.linears[module]
                if not wanted(infos["trellis"].name):
                    continue
                stored = {p: self.checkpoint.read_tensor(i.name) for p, i in infos.items()}
                shape = target.shape if isinstance(target, ExpertPiece) else self.slots[target][2].shape
                place(target, decode_linear(stored, *shape).to(self.dtype))
        dense = [name for name in self.dense if wanted(name)]
        for name, tensor in self.checkpoint.iter_tensors(dense):
            target = self.dense[name]
            place(target, tensor.to(self.dtype) if isinstance(target, ExpertPiece) else tensor)
        for name, value in fused.items():
            owner, _, _ = self.slots[name]
            owner._parameters[name.rpartition(".")[2]] = nn.Parameter(value, requires_grad=False)

    def decoded_bytes(self) -> int:
        """What the model's weights occupy decoded into the run's dtype (float32 where its dtype plan keeps
        them): every slot the files fill, the ignored tensors not counted."""
        size = torch.empty((), dtype=self.dtype).element_size()
        return sum(t.numel() * (4 if t.dtype == torch.float32 else size) for _, _, t in self.slots.values())

    def summary(self) -> dict[str, Any]:
        """What the decoded path runs: how many EXL3 Linear layers, their codebooks and bits."""
        run = [self.linears[module] for module in self.decoded]  # the ignored ones are not decoded
        bits = sorted({stored_bits(stored["trellis"]) for stored in run} - {None})
        ignored = {
            "ignored_tensors": len(self.ignored),
            "ignored_bytes": sum(self.checkpoint.tensors[name].nbytes for name in self.ignored),
        }
        return {
            "exl3_linears": len(run),
            "codebooks": sorted({codebook(stored) for stored in run}),
            "bits": bits,
            "ignored_on_load": ignored,
        }


def _split_expert(module: str) -> tuple[str | None, int, str]:
    """`a.b.experts.3.gate_proj` → ("a.b.experts", 3, "gate_proj"); (None, -1, "") for anything else."""
    head, _, proj = module.rpartition(".")
    experts, _, index = head.rpartition(".")
    return (experts, int(index), proj) if index.isdigit() and experts else (None, -1, "")


def eos_token_ids(checkpoint: Checkpoint, tokenizer: Any = None) -> set[int]:
    """The tokens exllamav3's greedy decoding stops at: config.json's `eos_token_id` (one or a list, at the
    top or in text_config; `model/config.py:163-175`), the tokenizer's EOS token, and every id of
    generation_config.json's `eos_token_id` (`tokenizer/tokenizer.py:199-215`)."""
    import json

    def ids(value: Any) -> set[int]:
        items = value if isinstance(value, list) else [value]
        return {int(v) for v in items if isinstance(v, int) and not isinstance(v, bool)}

    found = ids(
        checkpoint.config.get(
            "eos_token_id", (checkpoint.config.get("text_config") or {}).get("eos_token_id")
        )
    )
    if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
        found |= ids(tokenizer.eos_token_id)
    path = checkpoint.path / "generation_config.json"
    if path.is_file():
        try:
            document = json.loads(path.read_text(encoding="utf-8"))
        except ValueError as exc:
            raise InputError(f"generation_config.json is not valid JSON ({exc})", checkpoint.path) from None
        if isinstance(document, dict):
            found |= ids(document.get("eos_token_id"))
    return found


def check_exl3_load_plan(checkpoint: Checkpoint, options: BackendOptions) -> None:
    """Refuse, from the files alone, a pack the exl3 backend could not run faithfully (see the module
    docstring): InputError naming the file and the first problem."""
    if checkpoint.format != "exl3":
        raise InputError(
            f"is a {checkpoint.format} checkpoint, not an EXL3 pack: run it with --backend hf",
            checkpoint.path,
        )
    # What exllamav3 itself would trip on first; then what the pack says of itself.
    DecodedSkeleton(checkpoint, options).refuse_problems()
    storage = Exl3(checkpoint)
    if storage.storage_problem is None:
        found = storage_problems(storage.storage, checkpoint.tensors)
        if found:
            name, detail = found[0]
            more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
            raise InputError(
                f"{EXL3_CONFIG_FILE} disagrees with the files: {name}: {detail}{more}", checkpoint.path
            )


class DecodedExl3Backend(HFBackend):
    """The pack's Transformers model, every EXL3 Linear decoded; every `HFBackend` primitive runs on it."""

    def load_model(self, kwargs: dict[str, Any]) -> Any:
        """Build on the meta device, then decode and load every tensor from the files (nothing goes through
        `from_pretrained`, so `kwargs` go unused)."""
        skeleton = DecodedSkeleton(self.checkpoint, self.options)
        self.decoded_summary = skeleton.summary()
        return skeleton.load(self.options.device)

    def describe(self) -> dict[str, Any]:
        """The decoded path: what was decoded, and the Transformers model that runs it."""
        return decoded_execution(self.decoded_summary, self.model, self.checkpoint)


def decoded_execution(summary: dict[str, Any], model: nn.Module, checkpoint: Checkpoint) -> dict[str, Any]:
    """How the decoded path ran (loaded whole or streamed): what was decoded, the model that ran it, and
    what the model class ignored on load."""
    bits = ", ".join(str(b) for b in summary["bits"])
    ignored = summary["ignored_on_load"]
    left = (
        f"; {ignored['ignored_tensors']} tensors the model ignores on load not run"
        if ignored["ignored_tensors"]
        else ""
    )
    return {
        "backend": "exl3",
        "path": "decoded",
        "execution": (
            f"EXL3 decoded on the CPU by evalsuite ({summary['exl3_linears']} Linear layers, "
            f"{'/'.join(summary['codebooks'])}, K {bits}) into Transformers "
            f"{package_version('transformers')} ({type(model).__name__}); exllamav3 not run{left}"
        ),
        "format": checkpoint.format,
        **summary,
    }


class Exllamav3Backend:
    """The pack run by exllamav3 on CUDA: window logits and greedy generation. Its model is exllamav3's
    (`exl3_model`), not a Transformers model: it is no `HFModelAccess`, and lm-eval refuses it.

    Written from exllamav3 1.6.5's sources (`model/model.py`, `eval/ppl.py`) and not yet run: the
    development machines have no CUDA (see bench/exl3_gpu_check.sh, which compares this path's logits with
    the decoded path's).
    """

    def __init__(self, checkpoint: Checkpoint, options: BackendOptions) -> None:
        try:
            from exllamav3 import Config, Model
        except Exception as exc:  # the import compiles a CUDA extension: any failure means "cannot run"
            raise DependencyError(f"exllamav3 cannot be imported: {first_line(exc)}") from None
        self.checkpoint = checkpoint
        self.options = options
        self.device = torch.device("cuda:0" if options.device in ("cuda", "auto") else options.device)
        self.config = Config.from_directory(str(checkpoint.path))
        self.exl3_model = Model.from_config(self.config)
        # Full-window logits: the output buffer must hold a whole window (eval/ppl.py loads the same way).
        self.exl3_model.load(device=self.device, max_output_size=4096, max_output_factor=5)
        self.vocab_size = int(self.config.vocab_size)
        self.tokenizer = checkpoint.load_tokenizer(trust_remote_code=options.trust_remote_code)
        self.eos = eos_token_ids(checkpoint, self.tokenizer)

    def _logits(self, ids: torch.Tensor) -> torch.Tensor:
        out = self.exl3_model.forward(ids.reshape(1, -1), {"attn_mode": "flash_attn_nc"})
        return out[0, :, : self.vocab_size]

    @torch.inference_mode()
    def window_logits(self, windows: torch.Tensor, positions: torch.Tensor) -> Iterator[torch.Tensor]:
        """Each window forwarded on its own, without a cache; the logits at `positions`."""
        for window in windows:
            yield self._logits(window)[positions.to(self.device)].float().cpu()

    @torch.inference_mode()
    def generate_greedy(
        self, inputs: dict[str, torch.Tensor], max_new_tokens: int, top_k: int = 5, full_steps: int = 0
    ) -> Generation:
        """Greedy decoding, one full forward of the sequence so far per new token (no cache: slow, exact)."""
        import numpy as np

        ids = inputs["input_ids"].reshape(-1).tolist()
        tokens, rows = [], []
        for _ in range(max_new_tokens):
            logp = torch.log_softmax(self._logits(torch.tensor(ids))[-1].float(), dim=-1).cpu()
            rows.append(logp)
            token = int(logp.argmax())
            tokens.append(token)
            ids.append(token)
            if token in self.eos:
                break
        logp = torch.stack(rows)
        top_logp, top_ids = logp.topk(min(top_k, logp.shape[-1]), dim=-1)
        return Generation(
            tokens=tokens,
            top_ids=top_ids.numpy(),
            top_logp=top_logp.numpy(),
            full_logp=np.ascontiguousarray(logp[:full_steps].numpy()),
        )

    def image_features(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """Not on this path: the vision task skips EXL3 sides that run through exllamav3."""
        raise InputError("the exllamav3 path of the exl3 backend runs text only; use --device cpu for images")

    def describe(self) -> dict[str, Any]:
        """exllamav3's own execution of the pack."""
        return {
            "backend": "exl3",
            "path": "exllamav3",
            "execution": f"exllamav3 {package_version('exllamav3')} on {self.device}",
            "format": self.checkpoint.format,
        }

    def close(self) -> None:
        self.exl3_model.unload()
        del self.exl3_model
        torch.cuda.empty_cache()


def load_exl3_backend(checkpoint: Checkpoint, options: BackendOptions) -> Any:
    """exllamav3 where `exllamav3_path` says so, else the decoded Transformers model."""
    if exllamav3_path(options):
        return Exllamav3Backend(checkpoint, options)
    return DecodedExl3Backend(checkpoint, options)
