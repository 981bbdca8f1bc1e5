"""Streamed execution (`--stream`, or a model over `--max-memory`) against loaded runs, through the CLI.

Every `ppl` and `intref` metric of a streamed run must equal the loaded run's: the streamed layers are the
modules a loaded model holds, run by the same functions on the same tensors, so the logits are bit-identical
and the metrics equal exactly (the 1e-6 relative tolerance asked of them is not even needed). One loaded and
one streamed run per fixture pair, on a 2-window protocol; the streamed tiny run streams because the model
does not fit `--max-memory`, and the SmolLM2 one because of `--stream`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from evalsuite.backends import load_backend
from evalsuite.backends.options import BackendOptions
from evalsuite.backends.streamed import StreamedBackend
from evalsuite.files.checkpoint import Checkpoint
from evalsuite.fixtures import TINY_BF16, TINY_EXL3, TINY_W4A8
from tests.conftest import cli_run_in_process, copy_checkpoint, edit_tensors

TWO_WINDOWS = """
[protocol]
window = 512
starts = { first = 0, step = 4096, count = 2 }
scored = { first = 256, last = 510 }
"""
PPL_SPEC = TWO_WINDOWS + "[thresholds]\nppl_ratio = { max = 1.70 }\n"
INTREF_SPEC = (
    '[activations]\ndivisor = 127.5\nrounding = "half_even"\n'
    + TWO_WINDOWS
    + "[thresholds]\nppl_int_ratio = { max = 1.70 }\n"
)
# Strings that describe how a side ran (they say "streamed"), not what it measured.
EXECUTION = {"ref_execution", "ckpt_execution", "hf_convention", "int_convention"}


def specs(folder: Path) -> list[str]:
    (folder / "ppl.toml").write_text(PPL_SPEC)
    (folder / "intref.toml").write_text(INTREF_SPEC)
    return ["--spec", f"ppl={folder / 'ppl.toml'}", "--spec", f"intref={folder / 'intref.toml'}"]


def loaded_and_streamed(pair: dict[str, Path], ckpt: str, ref: str, root: Path, stream_args: tuple) -> dict:
    runs = {}
    for name, tasks, extra in (
        ("loaded", "ppl,intref", ()),
        ("streamed", "ppl,intref", stream_args),
    ):
        out = root / name
        res = cli_run_in_process(
            "run",
            "--ckpt",
            pair[ckpt],
            "--ref",
            pair[ref],
            "--tasks",
            tasks,
            "--corpus",
            "python-docs",
            *specs(root),
            *extra,
            "--out",
            out,
            "--quiet",
        )
        assert res.returncode == 0, res.stderr
        runs[name] = (json.loads((out / "results.json").read_text()), res.stderr)
    return runs


def assert_same_metrics(runs: dict) -> None:
    loaded, streamed = runs["loaded"][0]["tasks"], runs["streamed"][0]["tasks"]
    for task in ("ppl", "intref"):
        a, b = loaded[task]["metrics"], streamed[task]["metrics"]
        assert set(a) == set(b)
        numeric = [k for k, v in a.items() if isinstance(v, int | float) and not isinstance(v, bool)]
        assert len(numeric) > 25
        for name in numeric:
            assert math.isclose(b[name], a[name], rel_tol=1e-6, abs_tol=0.0), (task, name, a[name], b[name])
            assert b[name] == a[name], (task, name)  # bit-identical logits: the very same numbers
        for name in set(a) - set(numeric) - EXECUTION:
            assert b[name] == a[name], (task, name)
        assert loaded[task]["status"] == streamed[task]["status"] == "pass"


@pytest.fixture(scope="module")
def tiny_runs(tiny_pair, tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-stream")
    # 100 kB is far below the tiny model (~1 MB loaded): both sides stream without being asked.
    return loaded_and_streamed(
        tiny_pair, "tiny-minicpmv47-w4a8", "tiny-minicpmv47-bf16", root, ("--max-memory", "100kB")
    )


def test_tiny_pair_streamed_run_equals_loaded_run_on_every_ppl_and_intref_metric(tiny_runs):
    assert_same_metrics(tiny_runs)


def test_a_model_over_max_memory_streams_and_says_why(tiny_runs):
    results, stderr = tiny_runs["streamed"]
    said = " ".join(stderr.split())  # the console wraps long lines
    loads = said.count("loading ")
    assert loads == 3  # the reference, and the candidate under hf and under intref
    assert said.count(", streamed one decoder layer at a time: the model needs") == loads
    assert said.count("more than --max-memory 100.0 kB allows") == loads
    loaded_results, loaded_stderr = tiny_runs["loaded"]
    assert " ".join(loaded_stderr.split()).count("loading ") == 3 and "streamed" not in loaded_stderr
    assert "streamed" in results["tasks"]["ppl"]["metrics"]["ckpt_execution"]
    assert "streamed" not in loaded_results["tasks"]["ppl"]["metrics"]["ckpt_execution"]


@pytest.mark.slow
def test_smollm2_pair_streamed_run_equals_loaded_run_on_every_ppl_and_intref_metric(smollm2_pair, tmp_path):
    runs = loaded_and_streamed(
        smollm2_pair, "smollm2-135m-w4a8", "smollm2-135m-bf16", tmp_path, ("--stream",)
    )
    assert_same_metrics(runs)


# ---------------------------------------------------------------------------------------------------------
# Refusals: exit 2 with one line naming what is wrong, before any model loads.
# ---------------------------------------------------------------------------------------------------------


def refused(*args) -> str:
    res = cli_run_in_process("run", *args, "--quiet")
    assert res.returncode == 2, res.stderr
    assert len(res.error_lines) == 1, res.stderr
    return res.error_lines[0]


@pytest.mark.parametrize("size", ["lots", "0"])
def test_a_bad_max_memory_is_refused_naming_the_option(tiny_pair, tmp_path, size):
    line = refused(
        "--ckpt",
        tiny_pair["tiny-minicpmv47-w4a8"],
        "--ref",
        tiny_pair["tiny-minicpmv47-bf16"],
        f"--max-memory={size}",
        "--out",
        tmp_path,
    )
    assert "--max-memory" in line and size in line


def test_a_layer_whose_tensors_are_missing_is_refused_naming_the_layer(tiny_pair, tmp_path):
    broken = copy_checkpoint(tiny_pair["tiny-minicpmv47-bf16"], tmp_path / "broken")
    gone = "model.language_model.layers.1.mlp.shared_expert.up_proj.weight"
    edit_tensors(broken, lambda tensors: tensors.pop(gone))
    line = refused(
        "--ckpt", broken, "--ref", tiny_pair["tiny-minicpmv47-bf16"], "--stream", "--out", tmp_path / "out"
    )
    assert "decoder layer 1 (model.language_model.layers.1)" in line
    assert "1 tensors missing from the files (mlp.shared_expert.up_proj.weight)" in line
    assert str(broken) in line


FLAT_MODEL = '''
from torch import nn
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutput


class FlatConfig(PretrainedConfig):
    model_type = "flat-test"

    def __init__(self, vocab_size=512, hidden_size=16, num_hidden_layers=2, **kwargs):
        self.vocab_size, self.hidden_size, self.num_hidden_layers = vocab_size, hidden_size, num_hidden_layers
        super().__init__(**kwargs)


class FlatForCausalLM(PreTrainedModel, GenerationMixin):
    """Its blocks are an nn.Sequential, not a list of layers the forward calls one by one."""

    config_class = FlatConfig

    def __init__(self, config):
        super().__init__(config)
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.blocks = nn.Sequential(*(nn.Linear(config.hidden_size, config.hidden_size) for _ in range(2)))
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def forward(self, input_ids=None, logits_to_keep=0, **kwargs):
        return CausalLMOutput(logits=self.lm_head(self.blocks(self.embed(input_ids))))
'''


def test_a_model_whose_decoder_layers_cannot_be_found_is_refused_naming_its_class(tiny_pair, tmp_path):
    import torch
    from safetensors.torch import save_file

    flat = tmp_path / "flat"
    flat.mkdir()
    (flat / "modeling_flat.py").write_text(FLAT_MODEL)
    config = {
        "model_type": "flat-test",
        "architectures": ["FlatForCausalLM"],
        "auto_map": {
            "AutoConfig": "modeling_flat.FlatConfig",
            "AutoModelForCausalLM": "modeling_flat.FlatForCausalLM",
        },
        "vocab_size": 512,
        "hidden_size": 16,
        "num_hidden_layers": 2,
    }
    (flat / "config.json").write_text(json.dumps(config))
    tensors = {"embed.weight": torch.zeros(512, 16), "lm_head.weight": torch.zeros(512, 16)}
    for i in range(2):
        tensors |= {f"blocks.{i}.weight": torch.zeros(16, 16), f"blocks.{i}.bias": torch.zeros(16)}
    save_file({k: v.bfloat16() for k, v in tensors.items()}, str(flat / "model.safetensors"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (flat / name).write_bytes((tiny_pair["tiny-minicpmv47-bf16"] / name).read_bytes())
    line = refused(
        "--ckpt", flat, "--ref", flat, "--stream", "--trust-remote-code", "--out", tmp_path / "out"
    )
    assert "the decoder layers of FlatForCausalLM cannot be found" in line
    assert str(flat) in line


@pytest.mark.parametrize(
    ("fixture", "backend"),
    [(TINY_BF16, "hf"), (TINY_W4A8, "hf"), (TINY_W4A8, "intref"), (TINY_EXL3, "exl3")],
)
def test_a_streamed_side_reads_its_vision_tower_at_the_first_image_only(
    tiny_pair, tiny_exl3_pair, fixture, backend
):
    """A text pass never runs the vision tower: streamed, it stays on the meta device (at the real shape it
    is as large as a decoder layer), while the text path outside the layers is resident. At the first image
    it is read, and its features are those of the loaded model, bit for bit. A decoding without images sets
    it aside (where the loader can read it again), and the next image reads it again: the same features. A
    decoding of an image sets it aside once its first forward has merged the features, and answers as the
    loaded model does; so does a forward of an image's sequence (`sequences_logits`), with its logits."""
    from evalsuite.backends.multimodal import VisualProcessing
    from evalsuite.contract.spec import default_spec_path, load_spec
    from evalsuite.tasks.vision import VisionSpec, prepare_case

    checkpoint = Checkpoint.open({**tiny_pair, **tiny_exl3_pair}[fixture])
    options = BackendOptions(backend=backend)
    case = load_spec(VisionSpec, default_spec_path("vision")).resolved_cases()[0]
    tensors = prepare_case(case, VisualProcessing(checkpoint.path))["tensors"]
    streamed = StreamedBackend(checkpoint, options.streamed())
    try:
        model, text = streamed.model, streamed.loader.text

        def vision() -> list[torch.Tensor]:
            return [p for n, p in model.named_parameters() if not n.startswith(text)]

        assert vision() and all(p.is_meta for p in vision())
        assert not model.get_input_embeddings().weight.is_meta
        features = streamed.image_features(tensors)
        assert not any(p.is_meta for p in vision())
        streamed.generate_greedy_batch([{"input_ids": torch.tensor([[5, 17, 99]])}], [1], 5, 0)
        # The Transformers loader sets it aside; the integer and EXL3 loaders keep it resident.
        assert all(p.is_meta for p in vision()) == (backend == "hf")
        assert torch.equal(streamed.image_features(tensors), features)
        answer = streamed.generate_greedy_batch([tensors], [3], 5, 0)[0]
        assert all(p.is_meta for p in vision()) == (backend == "hf")
        positions = torch.arange(tensors["input_ids"].shape[-1] - 3, tensors["input_ids"].shape[-1])
        logits = streamed.sequence_logits(tensors, positions)
        assert all(p.is_meta for p in vision()) == (backend == "hf")
    finally:
        streamed.close()
    loaded = load_backend(checkpoint, options)
    try:
        assert torch.equal(features, loaded.image_features(tensors))
        assert loaded.generate_greedy_batch([tensors], [3], 5, 0)[0].tokens == answer.tokens
        assert torch.equal(loaded.sequence_logits(tensors, positions), logits)
    finally:
        loaded.close()


@pytest.mark.parametrize("side", [TINY_BF16, TINY_W4A8])
def test_a_streamed_decoding_reads_routed_experts_once_a_forward_and_leaves_no_hook_behind(tiny_pair, side):
    """Each decoding forward reads, of a layer's routed experts, those its tokens route to, through a hook
    of that read alone: the BF16 side keeps its layer modules between reads, and a hook left from an earlier
    forward read its experts again at every later one (the reads grew with the answer's length). Every
    forward runs the experts as a loaded model on the CPU does, and the answers are those of the side's own
    loaded `generate`."""
    checkpoint = Checkpoint.open(tiny_pair[side])
    backend = StreamedBackend(checkpoint, BackendOptions(stream=True))
    prompt = {"input_ids": torch.tensor([[5, 17, 99, 3, 42, 7]])}
    read_by: list[int] = []  # what the decoding had read when each forward reached the head
    experts_run: set[str] = set()  # the MoE experts' implementation each forward ran

    def at_head(*_: object) -> None:
        read_by.append(backend.generation_bytes)
        experts_run.add(backend.model.get_experts_implementation()["text_config"])

    head = backend.model.get_output_embeddings()
    handle = head.register_forward_pre_hook(at_head)
    try:
        streamed = backend.generate_greedy_batch([prompt], [6], 5, 0)[0]
    finally:
        handle.remove()
    experts = [m for layer in backend.layers for n, m in layer.named_modules() if n.endswith("experts")]
    assert experts and all(not m._forward_pre_hooks for m in experts)
    assert all(m.num_experts == backend.model.config.get_text_config().num_experts for m in experts)
    assert backend.generation_forwards == len(read_by) == 6
    # A loaded model on the CPU decodes with the experts' `grouped_mm`; Transformers switched a streamed one
    # (its first parameter on the meta device) to `batched_mm` for the decoding steps.
    assert experts_run == {"grouped_mm"}
    # The prompt's six tokens route to more experts than one new token: each later forward reads less.
    reads = [b - a for a, b in zip([0, *read_by], read_by, strict=False)]
    assert all(0 < step < reads[0] <= sum(backend.layer_bytes) for step in reads[1:]), reads
    backend.close()
    loaded = load_backend(checkpoint, BackendOptions())
    assert streamed.tokens == loaded.generate_greedy(prompt, 6).tokens
    loaded.close()


def test_a_streamed_w4a8_decoding_copies_no_quantization_config(tiny_pair, monkeypatch):
    """Transformers' loading copies a converter for every tensor it is given; the operation that decompresses
    the pack holds the whole compressed-tensors config, which was copied with it, at every forward of a
    streamed decoding. It is shared now: a decoding copies none of the config's models, and its answer is
    unchanged (the test above compares the answers with the loaded model's)."""
    import pydantic

    backend = StreamedBackend(Checkpoint.open(tiny_pair[TINY_W4A8]), BackendOptions(stream=True))
    copied: list[str] = []
    deepcopy = pydantic.BaseModel.__deepcopy__

    def counted(model: pydantic.BaseModel, memo: dict | None = None) -> pydantic.BaseModel:
        copied.append(type(model).__name__)
        return deepcopy(model, memo)

    monkeypatch.setattr(pydantic.BaseModel, "__deepcopy__", counted)
    try:
        answer = backend.generate_greedy_batch([{"input_ids": torch.tensor([[5, 17, 99, 3]])}], [3], 5, 0)[0]
    finally:
        backend.close()
    assert len(answer.tokens) == 3 and backend.generation_forwards == 3
    assert copied == []
