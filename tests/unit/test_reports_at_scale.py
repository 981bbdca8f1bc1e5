"""Reports at the real shape of MiniCPM-V-4.7-35B-A3B: 40 MoE layers of 256 routed experts (10,240 experts)
and about 31,000 quantized projections. A person reads the worst few and the totals; results.json and
report.md stay the same size however many experts or tensors there are, and every row is in an artifact file.

The compare inputs are built at that shape (observation arrays as the observers write them, tensor rows as
`verify_tensors` writes them), with values drawn from a seeded generator: the sizes are the point, not the
values."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np

from evalsuite.contract.observation import Observation
from evalsuite.contract.spec import default_spec_path, load_spec
from evalsuite.protocol.task import RunContext, TaskResult
from evalsuite.reporting.diff_report import render_markdown
from evalsuite.tasks.moe import COVERAGE_SCHEMA, MODES, MixtureOfExperts, MoeSpec, read_coverage
from evalsuite.tasks.tensors import summary_tables
from evalsuite.tasks.tensors._verification import TensorRow
from tests.documents import results_document

N_LAYERS, N_EXPERTS, TOP_K, N_WINDOWS, WINDOW = 40, 256, 8, 8, 512
# What a person can read: one row per MoE layer in the routing table, the worst N experts in each expert
# table; a results.json entry and a report.md section a reviewer opens without scrolling through 10,240 rows.
MAX_DETAIL_ROWS = N_LAYERS + 3 * 20 + 20
MAX_BYTES = 64 * 1024


def moe_observations(rng: np.random.Generator, layers: int, experts: int) -> dict[str, Observation]:
    """The `moe` task's two observations for `layers` MoE layers of `experts` routed experts: usage skewed
    as a real router's is (some experts unused), every used expert with an error."""
    tokens = N_WINDOWS * WINDOW
    share = rng.dirichlet(np.full(experts, 0.3), size=layers)
    usage = np.stack([rng.multinomial(tokens * TOP_K, p) for p in share]).astype(np.float64)
    weight = usage / TOP_K
    rel_err = np.where(usage > 0, rng.lognormal(np.log(0.08), 0.4, usage.shape), 0.0)
    ref_sq = weight * 4.0
    err_sq = ref_sq * rel_err**2
    expert_sums = np.stack([usage, weight, ref_sq, err_sq, ref_sq + err_sq, ref_sq], axis=-1)
    routing = np.zeros((len(MODES), layers, N_WINDOWS, 5))
    routing[..., 0] = WINDOW
    routing[..., 1] = WINDOW * rng.uniform(0.85, 1.0, routing.shape[:-1])
    routing[..., 2] = WINDOW * rng.uniform(0.8, 1.0, routing.shape[:-1])
    routing[..., 3] = WINDOW * rng.uniform(0.85, 1.0, routing.shape[:-1])
    routing[..., 4] = WINDOW * rng.uniform(0.0, 0.05, routing.shape[:-1])
    n, ref_state = WINDOW * 2048, 2048.0 * WINDOW
    shared = np.zeros((layers, N_WINDOWS, 6))
    shared[...] = [n, ref_state, ref_state * 1e-4, ref_state, ref_state, 0.01]
    moe_layers = list(range(layers))
    ref = Observation(
        name="moe-reference",
        meta={
            "moe_layers": moe_layers,
            "layer_kinds": ["full_attention" if i % 4 == 3 else "linear_attention" for i in moe_layers],
            "top_k": TOP_K,
            "shared_expert": True,
            "corpus": "wikitext-2-raw-v1",
            "bytes_per_token": 1,
        },
        arrays={"usage": usage, "usage_weight": weight},
    )
    ckpt = Observation(
        name="moe-errors",
        meta={"n_windows": N_WINDOWS, "fed_windows": list(range(N_WINDOWS)), "tokens_sha256": "0" * 64},
        arrays={"routing": routing, "experts": expert_sums, "shared": shared},
    )
    return {"ref": ref, "ckpt": ckpt}


def moe_result(tmp_path: Path, layers: int, experts: int) -> TaskResult:
    """`moe`'s compare at this shape, with a calibration coverage file in which most experts fall below the
    floor (a pack calibrated on too little text)."""
    rng = np.random.default_rng(0)
    coverage = tmp_path / f"coverage-{layers}x{experts}.json"
    counts = rng.integers(0, 64, size=(layers, experts))
    doc = {f"{i}.{e}": int(counts[i, e]) for i in range(layers) for e in range(experts) if counts[i, e]}
    coverage.write_text(json.dumps({"schema": COVERAGE_SCHEMA, "tokens": doc}))
    task = MixtureOfExperts(load_spec(MoeSpec, default_spec_path("moe")), RunContext())
    task.coverage, task.coverage_path = read_coverage(coverage, range(layers), experts), coverage
    artifacts = tmp_path / f"moe-{layers}x{experts}"
    artifacts.mkdir()
    result = task.compare(moe_observations(rng, layers, experts), artifacts)
    result.descriptions = dict(MixtureOfExperts.metric_descriptions)
    return result


def sizes(name: str, result: TaskResult) -> tuple[int, int, int]:
    """(detail rows, bytes of its results.json entry, bytes of report.md) of one task's result."""
    entry = result.to_json()
    report = render_markdown(results_document(**{name: entry}))
    return len(entry.get("details", [])), len(json.dumps(entry, indent=2)), len(report.encode())


def test_moe_reports_the_worst_experts_and_totals_not_ten_thousand_rows(tmp_path):
    result = moe_result(tmp_path, N_LAYERS, N_EXPERTS)
    rows, entry_bytes, report_bytes = sizes("moe", result)
    assert rows <= MAX_DETAIL_ROWS
    assert entry_bytes <= MAX_BYTES and report_bytes <= MAX_BYTES
    m = result.metrics
    assert m["n_experts"] == N_LAYERS * N_EXPERTS and m["coverage_below_floor"] > 1000
    # Every expert is in the artifact, one row each.
    with (tmp_path / "moe-40x256" / "moe_experts.csv").open() as fh:
        table = list(csv.DictReader(fh))
    assert len(table) == N_LAYERS * N_EXPERTS
    assert sum(row["below_floor"] == "True" for row in table) == m["coverage_below_floor"]


def test_moe_report_size_does_not_grow_with_the_number_of_experts(tmp_path):
    few = sizes("moe", moe_result(tmp_path, N_LAYERS, 32))
    many = sizes("moe", moe_result(tmp_path, N_LAYERS, N_EXPERTS))
    assert many[0] == few[0]
    assert many[1] <= 1.1 * few[1] and many[2] <= 1.1 * few[2]


def real_shape_tensor_rows(rng: np.random.Generator) -> list[TensorRow]:
    """The rows `verify_tensors` writes for the 35B W4A8 pack's quantized projections: 40 layers × 256
    experts × 3 and 130 attention projections (30 Gated DeltaNet layers × 3, 10 full-attention layers × 4) in
    INT4, 40 × 3 shared-expert projections and the head in INT8; plus each layer's protected norms."""
    rows: list[TensorRow] = []

    def add(
        module: str, projection: str, layer: int | None, bits: int, group: str, part: str = "text"
    ) -> None:
        quantized = bits > 0
        rows.append(
            TensorRow(
                name=f"{module}.weight",
                tensor_class="quantized" if quantized else "protected",
                module=module,
                kind="linear" if quantized else "norm",
                part=part,
                layer=layer,
                projection=projection,
                dtype="BF16",
                shape=(512, 2048),
                numel=512 * 2048,
                candidate_tensors=[f"{module}.weight_packed", f"{module}.weight_scale"],
                format=("pack-quantized" if bits == 4 else "int-quantized") if quantized else None,
                group=group or None,
                bits=bits or None,
                rel_err=float(rng.lognormal(np.log(0.1 if bits == 4 else 0.007), 0.1)) if quantized else None,
                identical=None if quantized else True,
            )
        )

    for layer in range(N_LAYERS):
        prefix = f"model.language_model.layers.{layer}"
        for e in range(N_EXPERTS):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                add(
                    f"{prefix}.mlp.experts.{e}.{proj}",
                    f"mlp.experts.*.{proj}",
                    layer,
                    4,
                    "int4_routed_experts",
                )
        attention = (
            ("q_proj", "k_proj", "v_proj", "o_proj")
            if layer % 4 == 3
            else ("in_proj_qkv", "in_proj_z", "out_proj")
        )
        block = "self_attn" if layer % 4 == 3 else "linear_attn"
        for proj in attention:
            add(f"{prefix}.{block}.{proj}", f"{block}.{proj}", layer, 4, "int4_attention")
        for proj in ("gate_proj", "up_proj", "down_proj"):
            add(f"{prefix}.mlp.shared_expert.{proj}", f"mlp.shared_expert.{proj}", layer, 8, "int8_shared")
        for norm in ("input_layernorm", "post_attention_layernorm"):
            add(f"{prefix}.{norm}", norm, layer, 0, "")
    add("lm_head", "lm_head", None, 8, "int8_shared", part="head")
    return rows


def test_thirty_thousand_tensors_are_summarised_by_projection_and_the_worst(tmp_path):
    rows = real_shape_tensor_rows(np.random.default_rng(0))
    assert sum(r.bits == 4 for r in rows) == 30_850 and sum(r.bits == 8 for r in rows) == 121
    details = summary_tables(rows, worst=10, projections=40)
    result = TaskResult(status="pass", metrics={"source_tensors": len(rows)}, details=details)
    n, entry_bytes, report_bytes = sizes("tensors", result)
    assert n <= 40 and entry_bytes <= MAX_BYTES and report_bytes <= MAX_BYTES
    by_projection = {r["projection"]: r for r in details if r["table"].startswith("quantized tensors by")}
    # The 10,240 tensors of each expert projection are one row: how many, over which layers, the worst named.
    experts = by_projection["mlp.experts.*.down_proj"]
    assert experts["tensors"] == N_LAYERS * N_EXPERTS and experts["layers"] == "0–39"
    worst = max((r for r in rows if r.projection == "mlp.experts.*.down_proj"), key=lambda r: r.rel_err)
    assert experts["worst_tensor"] == worst.name and experts["worst_rel_err"] == worst.rel_err
    listed = [r for r in details if r["table"].startswith("the worst quantized tensors")]
    assert len(listed) == 10 and listed[0]["rel_err"] == max(r.rel_err or 0 for r in rows)
    # Past the limit, the table says how many groups it leaves out rather than growing.
    capped = summary_tables(rows, worst=10, projections=5)
    assert [r["projection"] for r in capped if r["table"].startswith("quantized")][
        -1
    ] == "9 more: see tensors.csv"
