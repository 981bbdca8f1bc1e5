"""Long-context `ppl` on the tiny MiniCPM-V 4.7 pair: a 1,024-token window through its linear-attention
(gated delta rule) and full-attention layers, the head applied per chunk of positions and each chunk reduced
at once to what the comparison needs (the reference's compact form, the candidate's log-probs at its ids).

The CLI runs in this process (`cli_in_process`): what is tested is the protocol, not the interpreter. One
chunked run is shared by the tests below; each other model run adds one side's forward at most.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from evalsuite.backends import token_chunks
from evalsuite.backends.hf import HFBackend
from evalsuite.backends.options import BackendOptions
from evalsuite.backends.streamed import StreamedBackend
from evalsuite.files.checkpoint import Checkpoint
from evalsuite.fixtures import TINY_BF16, TINY_W4A8
from evalsuite.observers.compact_window_logits import (
    CompactWindowLogits,
    LogitsAtReference,
    detail_at_reference,
)
from evalsuite.observers.window_logits import RecordOptions, WindowProtocol, tokens_sha256
from evalsuite.protocol.task import no_progress
from tests.conftest import assert_refused, cli_in_process

WINDOW = 1024
SPEC = f"""
[protocol]
window = {WINDOW}
starts = {{ first = 0, step = {WINDOW}, count = 1 }}
scored = {{ first = 0, last = {WINDOW - 2} }}

[long_context]
head_chunk_rows = HEAD_ROWS
position_buckets = [0, 256, 512]
every_window = true

[thresholds]
ppl_ratio = {{ max = 1.70 }}
"""
BUCKETS = ("pos_0_256", "pos_256_512", "pos_512_inf")


def _spec(folder: Path, head_rows: int) -> Path:
    path = folder / f"ppl-long-{head_rows}.toml"
    path.write_text(SPEC.replace("HEAD_ROWS", str(head_rows)), encoding="utf-8")
    return path


def _long_window() -> tuple[torch.Tensor, torch.Tensor]:
    """One window of `WINDOW` token ids and every position of it that predicts a next token."""
    return torch.from_numpy(np.arange(WINDOW, dtype=np.int64) % 500)[None], torch.arange(0, WINDOW - 1)


def _run(out: Path, ckpt: Path, ref: Path, spec: Path, *extra: str | Path) -> dict:
    args = ("run", "--ckpt", ckpt, "--ref", ref, "--tasks", "ppl", "--spec", f"ppl={spec}")
    code, lines, _ = cli_in_process(*args, "--corpus", "python-docs", "--out", out, "--quiet", *extra)
    assert code == 0, lines
    return json.loads((out / "results.json").read_text(encoding="utf-8"))["tasks"]["ppl"]


@pytest.fixture(scope="module")
def chunked(tiny_pair, tmp_path_factory) -> tuple[Path, dict]:
    """The W4A8 copy against its source, one 1,024-token window, the head applied 100 positions at a time
    (not a divisor of the 1,023 scored positions: the last chunk is short)."""
    folder = tmp_path_factory.mktemp("long-context")
    out = folder / "chunked"
    return out, _run(out, tiny_pair[TINY_W4A8], tiny_pair[TINY_BF16], _spec(folder, 100))


def test_metrics_come_by_position_bucket_with_a_plot(chunked):
    out, result = chunked
    m = result["metrics"]
    assert m["n_scored_tokens"] == WINDOW - 1 and m["head_chunk_rows"] == 100 and m["kld_mean"] > 0
    assert [m[f"{b}_n_tokens"] for b in BUCKETS] == [256, 256, 511]
    weighted = sum(m[f"{b}_kld_mean"] * m[f"{b}_n_tokens"] for b in BUCKETS)
    assert weighted / m["n_scored_tokens"] == pytest.approx(m["kld_mean"], rel=1e-12)
    # The reference's compact form (top-64 and 64 tail samples: ids int32, log-probs float32; the tail mass,
    # NLL and top token 8 bytes each; 5 ranked ids, int32), the candidate's log-probs at those ids (float32),
    # its NLL, top token, 5 ranked ids and whether the top tokens agree (1 byte): set by the spec, not the
    # vocabulary.
    assert m["ref_stored_bytes_per_token"] == 8 * 64 + 8 * 64 + 24 + 4 * 5
    assert m["ckpt_stored_bytes_per_token"] == 4 * (64 + 64) + 16 + 4 * 5 + 1 + 5
    assert "compact form" in m["kld_estimator"]
    observations = [p for p in (out / "observations").iterdir() if not p.name.startswith(".")]
    assert {p.name.split("-window-logits")[0] for p in observations} == {"ref", "ckpt"}
    assert not [f for p in observations for f in p.rglob("*") if f.suffix == ".npy"]  # no logits files
    assert (out / result["artifacts"]["kld_by_position"]).stat().st_size > 0


def test_an_identical_candidate_gives_kld_zero_in_every_bucket(chunked, tiny_pair, tmp_path):
    out, _ = chunked
    spec = _spec(tmp_path, 100)
    shutil.copytree(out, tmp_path / "same")  # the reference's observation is reused: no model loads
    m = _run(tmp_path / "same", tiny_pair[TINY_BF16], tiny_pair[TINY_BF16], spec)["metrics"]
    for bucket in BUCKETS:
        assert m[f"{bucket}_kld_mean"] == 0.0 and m[f"{bucket}_same_top_p"] == 1.0, bucket
        assert m[f"{bucket}_delta_p_mean"] == 0.0 and m[f"{bucket}_ln_ppl_ratio"] == 0.0, bucket


def test_a_recorded_reference_replays_the_long_protocol(chunked, tiny_pair, tmp_path):
    out, result = chunked
    spec = _spec(tmp_path, 100)
    rec = tmp_path / "rec"
    code, lines, _ = cli_in_process(
        "record", "--ckpt", tiny_pair[TINY_BF16], "--tasks", "ppl", "--spec", f"ppl={spec}",
        "--corpus", "python-docs", "--out", rec, "--quiet",
    )  # fmt: skip
    assert code == 0, lines
    manifest = json.loads((rec / "manifest.json").read_text(encoding="utf-8"))
    assert "window-logits-compact" in json.dumps(manifest)
    shutil.copytree(out, tmp_path / "replay")  # the candidate's observation is reused
    replay = _run(tmp_path / "replay", tiny_pair[TINY_W4A8], rec, spec)["metrics"]
    live = result["metrics"]
    # The live reference's observation is its recording: the replay gives the live run's numbers, bit for bit.
    for name in ("ppl_ref", "kld_mean", "kld_p99", "same_top_p", "top5_agreement", "pos_512_inf_kld_mean"):
        assert replay[name] == live[name], name
    assert replay["pos_512_inf_n_tokens"] == 511


def test_the_compact_estimate_is_near_the_full_vocabulary_kld_and_the_rest_is_unchanged(
    chunked, tiny_pair, tmp_path
):
    """Against both sides' full logits (the head on every scored position at once, head_chunk_rows = 0):
    the NLLs and top tokens are the same numbers, and KL(ref ‖ ckpt) from the reference's top-64 + 64
    sampled tail ids lies near the full-vocabulary one."""
    _, result = chunked
    whole = _run(tmp_path / "whole", tiny_pair[TINY_W4A8], tiny_pair[TINY_BF16], _spec(tmp_path, 0))[
        "metrics"
    ]
    compact = result["metrics"]
    assert whole["kld_estimator"] == "full-vocabulary" and "kld_reverse_mean" not in compact
    nll_metrics = (
        "ppl_ref",
        "ppl_ckpt",
        "ppl_ratio",
        "delta_p_mean",
        "rms_delta_p",
        "pos_512_inf_ln_ppl_ratio",
    )
    for name in (*nll_metrics, "same_top_p", "top2_agreement", "top5_agreement"):
        assert compact[name] == whole[name], name
    assert compact["kld_mean"] == pytest.approx(whole["kld_mean"], rel=0.05)


def test_the_floor_on_long_windows_is_observed_at_the_reference_ids_loaded_and_streamed_alike(
    chunked, tiny_pair, tmp_path
):
    """The noise floor on long windows is observed as the candidate is: its log-probs at the ids the
    reference's compact form kept, chunk by chunk, never its logits (which at a 248 k vocabulary would be
    16 GB a 32 k window). The same draws loaded and streamed: the same floor, bit for bit; and a floor that
    is not the reference's own noisy run (another seed) moves it."""
    out, result = chunked
    floor_spec = tmp_path / "ppl-long-floor.toml"
    floor_text = SPEC.replace("HEAD_ROWS", "100") + "\n[noise_floor]\nenabled = true\ndraws = 1\n"
    floor_spec.write_text(floor_text, encoding="utf-8")
    floors = {}
    for how, extra in (("loaded", ()), ("streamed", ("--stream",))):
        shutil.copytree(out, tmp_path / how)  # the reference's and the candidate's observations are reused
        ckpt, ref = tiny_pair[TINY_W4A8], tiny_pair[TINY_BF16]
        floors[how] = _run(tmp_path / how, ckpt, ref, floor_spec, *extra)["metrics"]
        made = [p for p in (tmp_path / how / "observations").iterdir() if "noise" in p.name]
        assert len(made) == 1 and "window-logits-at-reference-noise" in made[0].name, made
        assert not [f for f in made[0].rglob("*") if f.suffix == ".npy"]  # no logits file
    loaded, streamed = floors["loaded"], floors["streamed"]
    assert 0 < loaded["kld_floor"] < loaded["kld_mean"] and "compact form" in loaded["kld_estimator"]
    for name in ("kld_floor", "kld_floor_ratio", "kld_above_floor", "noise_floor", "kld_mean"):
        assert streamed[name] == loaded[name], name
    assert loaded["kld_mean"] == result["metrics"]["kld_mean"]  # the candidate's figures are its own
    assert loaded["noise_floor"] == "undetermined"  # one window: no clustered error to bound with
    other_seed = tmp_path / "ppl-long-floor-seed.toml"
    other_seed.write_text(floor_text.replace("draws = 1", "draws = 1\nseed = 7"), encoding="utf-8")
    shutil.copytree(out, tmp_path / "seed")
    seeded = _run(tmp_path / "seed", tiny_pair[TINY_W4A8], tiny_pair[TINY_BF16], other_seed)["metrics"]
    assert seeded["kld_floor"] != loaded["kld_floor"]


class _VocabularyRows(TorchDispatchMode):
    """Notes the most rows any tensor of `vocab` columns (logits, log-probs) had in the ops run under it."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab, self.most = vocab, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-1] == self.vocab:
                self.most = max(self.most, t.numel() // self.vocab)
        return out


def test_no_side_holds_more_than_a_chunk_of_vocabulary_rows(tiny_pair, tmp_path):
    """Both long-window observers make the head's logits `head_chunk_rows` positions at a time and reduce
    each chunk at once: no tensor of more vocabulary rows than a chunk is ever made (the model's own head on
    the whole window makes one of every scored position), and what a side keeps per scored token is set by
    the record options, not by the vocabulary."""
    window, positions = _long_window()
    protocol = WindowProtocol(
        window=WINDOW,
        starts={"first": 0, "step": WINDOW, "count": 1},
        scored={"first": 0, "last": WINDOW - 2},
    )
    inputs = {
        "windows": window.numpy(),
        "starts": [0],
        "tokens_sha256": tokens_sha256(window.numpy()),
        "corpus": "ids",
        "n_tokens_text": WINDOW,
    }
    record = RecordOptions(top_k=8, tail_samples=8)
    observed = {}
    for role, name, observer in (
        ("ref", TINY_BF16, CompactWindowLogits(protocol, record, chunk_rows=16, head_rows=100)),
        ("ckpt", TINY_W4A8, LogitsAtReference(protocol, chunk_rows=16, head_rows=100)),
    ):
        (tmp_path / role).mkdir()
        backend = HFBackend(Checkpoint.open(tiny_pair[name]), BackendOptions())
        try:
            seen = _VocabularyRows(backend.vocab_size)
            with seen:
                observed[role] = observer.observe(
                    backend, {**inputs, "observed": observed}, tmp_path / role, no_progress
                )
            assert 0 < seen.most <= 100, role
            if role == "ref":
                whole = _VocabularyRows(backend.vocab_size)
                with whole:
                    next(iter(backend.window_logits(window, positions)))
                assert whole.most == len(positions)  # the check sees a whole window's logits where made
        finally:
            backend.close()
        assert not list((tmp_path / role).iterdir())  # every window's part is in the observation's arrays
    ref, ckpt = observed["ref"], observed["ckpt"]
    # Less than one bf16 logits row of the 512-token vocabulary (1,024 bytes), with top-8 and 8 samples.
    assert ref.meta["bytes_per_token"] == 8 * 8 + 8 * 8 + 24 + 4 * 5 < 512 * 2
    assert ckpt.meta["bytes_per_token"] == 4 * (8 + 8) + 16 + 4 * 5 + 1 + 5
    assert ref.arrays["top_ids"].shape == ckpt.arrays["at_top"].shape == (len(positions), 8)
    _, kld, estimator = detail_at_reference(ref, ckpt)
    assert kld.shape == (len(positions),) and np.isfinite(kld).all() and kld.mean() > 0
    assert estimator.startswith("top-8 exact + 8 sampled tail ids")


def test_a_text_shorter_than_the_windows_is_refused(tiny_pair, tmp_path):
    text = tmp_path / "short.txt"
    text.write_text("A short text. " * 40, encoding="utf-8")
    args = ("run", "--ckpt", tiny_pair[TINY_W4A8], "--ref", tiny_pair[TINY_BF16], "--tasks", "ppl")
    code, lines, _ = cli_in_process(
        *args, "--spec", f"ppl={_spec(tmp_path, 100)}", "--text-file", text, "--out", tmp_path / "o"
    )
    assert_refused(code, lines, "fewer than one 1024-token window")
    spec = tmp_path / "two.toml"
    spec.write_text(_spec(tmp_path, 100).read_text().replace("count = 1", "count = 100000"), encoding="utf-8")
    code, lines, _ = cli_in_process(
        *args, "--spec", f"ppl={spec}", "--corpus", "python-docs", "--out", tmp_path / "p"
    )
    assert_refused(code, lines, "too short for the protocol's 100000 window(s) of 1024 tokens")
    assert not (tmp_path / "o").exists() and not (tmp_path / "p" / "results.json").exists()


def test_a_window_beyond_the_models_context_is_refused(tiny_pair, tmp_path):
    spec = tmp_path / "long.toml"
    spec.write_text(
        SPEC.replace("HEAD_ROWS", "100").replace(str(WINDOW - 2), "8190").replace(str(WINDOW), "8192"),
        encoding="utf-8",
    )
    code, lines, _ = cli_in_process(
        "run", "--ckpt", tiny_pair[TINY_W4A8], "--ref", tiny_pair[TINY_BF16], "--tasks", "ppl",
        "--spec", f"ppl={spec}", "--corpus", "python-docs", "--out", tmp_path / "o",
    )  # fmt: skip
    assert_refused(code, lines, "8192-token window is longer than the model's context (4096 tokens")


def test_the_head_per_chunk_gives_the_logits_of_the_whole_head_loaded_and_streamed(tiny_pair):
    """Past 512 tokens through the linear-attention layer: the chunks (100 rows, the last one short) are the
    logits the model's own forward returns for every scored position at once, bit for bit, loaded and
    streamed. And the check can fail: compressed-tensors' per-token INT8 activations read a 2-D input as one
    token, so the W4A8 copy's INT8 head applied to (positions, hidden) instead of the forward's (1, positions,
    hidden) gives other logits."""
    checkpoint = Checkpoint.open(tiny_pair[TINY_W4A8])
    window, positions = _long_window()
    backend = HFBackend(checkpoint, BackendOptions())
    try:
        whole = next(iter(backend.window_logits(window, positions)))
        states = next(iter(backend.window_scored_states(window, positions)))
        assert torch.equal(torch.cat(list(states.chunks(100))), whole)
        with torch.inference_mode():
            flat = torch.cat([states.head(states.hidden[i : i + 100]) for i in range(0, len(states), 100)])
        assert not torch.equal(flat, whole)
    finally:
        backend.close()
    streamed = StreamedBackend(checkpoint, BackendOptions(stream=True))
    try:
        states = next(iter(streamed.window_scored_states(window, positions)))
        assert torch.equal(torch.cat(list(states.chunks(100))), whole)
    finally:
        streamed.close()


def test_past_the_mlp_chunk_the_mlps_run_per_chunk_loaded_and_streamed_alike(tiny_pair, monkeypatch):
    """A window longer than `MLP_CHUNK_ROWS` runs every decoder layer's MLP (here the routed experts and the
    shared expert) a chunk of positions at a time: the logits are those of the whole MLP to the rounding of a
    shorter matrix product, loaded and streamed give the same ones bit for bit, and the model's own MLP
    forward is back afterwards."""
    checkpoint = Checkpoint.open(tiny_pair[TINY_BF16])
    window, positions = _long_window()
    backend = HFBackend(checkpoint, BackendOptions())
    try:
        whole = next(iter(backend.window_logits(window, positions)))
        monkeypatch.setattr(token_chunks, "MLP_CHUNK_ROWS", 300)  # 1,024 positions: 300, 300, 300, 124
        calls: list[int] = []
        mlp = backend.model.get_decoder().layers[0].mlp
        mlp.shared_expert.register_forward_pre_hook(lambda _, args: calls.append(args[0].shape[-2]))
        chunked = next(iter(backend.window_logits(window, positions)))
        assert calls == [300, 300, 300, 124]
        assert "forward" not in mlp.__dict__  # the model's own forward again
        torch.testing.assert_close(chunked.float(), whole.float(), rtol=0.02, atol=0.05)
        with token_chunks.mlp_in_chunks(backend.model) as split:
            assert split == checkpoint.config["text_config"]["num_hidden_layers"]
    finally:
        backend.close()
    streamed = StreamedBackend(checkpoint, BackendOptions(stream=True))
    try:
        assert torch.equal(next(iter(streamed.window_logits(window, positions))), chunked)
    finally:
        streamed.close()
