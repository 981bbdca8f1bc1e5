"""Mixture of experts: does the candidate route like the reference, and which routed experts did it hurt?

Both sides run streamed over the `ppl` windows, like `layers`: first the reference alone, then the candidate
alone, consuming the reference's observation, so that at no moment more than one decoder layer of one side is
resident, and a recorded reference serves without its weights.

The router and the experts are the model's own modules, found through the model's own declaration of what it
records as `router_logits` (`_can_record_outputs`, the class `output_router_logits` collects; in Transformers
5.24's `qwen3_5_moe`, `Qwen3_5MoeTopKRouter`: a linear layer, a float32 softmax, top-k, the top-k weights
renormalised to sum 1, returned as (logits, weights, indices); modeling_qwen3_5_moe.py lines 894-910). Its MoE
block is the router's parent module: `experts` (fused 3-D weights, called as `experts(x, indices, weights)`)
and, where present, `shared_expert` (an MLP; Qwen3.5 scales its output by a sigmoid gate, left out here: the
shared expert's damage is that of the module). Nothing is computed outside those modules' own forwards:

- **reference** (`MoeReference`): per MoE layer and token, the block's input (captured by a forward pre-hook),
  the router's (logits, weights, indices) (a forward hook), each chosen expert's own output on that token (the
  experts module called on the token once per chosen expert, with weight 1) and the shared expert's output;
  with the hidden states at every layer boundary, in the `layers` format. Size per token: (layers + 1) ×
  hidden + MoE layers × (k + 2) × hidden values in the compute dtype, plus MoE layers × (experts + 2k) × 4
  bytes.
- **candidate** (`MoeErrors`): its layer on its own prefix (`own`), its layer fed the reference's input to the
  layer (`fed`, as `layers` does: router inputs shifted by its attention show here) and its router alone on
  the reference's router input (`router`); each routed expert on the tokens the reference routes to it,
  against the reference's expert output, weighted by the reference's routing weight; the shared expert on
  every token. `own`, `router` and usage cover every window; `fed` and the experts' errors, which run the
  candidate's layer and experts once more (and the reference's experts), the windows of the spec's `[fed]`
  (`FedOptions`). An expert the text uses but those windows never route to is counted as unmeasured.

Routing agreement per MoE layer and mode: mean top-k set overlap |A∩B|/k, top-1 agreement, the candidate's
routing weight on the reference's chosen experts, KL(softmax(ref logits) ‖ softmax(ckpt logits)). Expert usage
(tokens routed to each expert) is the reference's. Calibration coverage, when the candidate's folder ships a
JSON of per-expert calibration token counts (`read_coverage`), is joined with usage and damage.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
from pydantic import Field

from evalsuite.contract.observation import Observation
from evalsuite.contract.spec import StrictModel, TaskSpec
from evalsuite.errors import InputError
from evalsuite.files.run_folder import write_csv
from evalsuite.observers.boundary_states import FedOptions, summed_errors
from evalsuite.observers.window_logits import WindowProtocol, prepare_windows
from evalsuite.plotting import plots
from evalsuite.protocol.side import Side
from evalsuite.protocol.task import Inputs, Need, RunContext, TaskResult, TaskSkipped, task
from evalsuite.tasks.moe._observe import EXPERT_COUNT_FIELDS, MODES, MoeErrors, MoeReference, expert_count
from evalsuite.tasks.moe._tables import COVERAGE_SCHEMA, ExpertTable, expert_name, read_coverage

# Names of moe_observe and moe_tables that callers have always imported from here.
__all__ = ["COVERAGE_SCHEMA", "MODES", "MixtureOfExperts", "MoeSpec", "expert_count", "read_coverage"]


# The metrics measured on the fed windows alone (`FedOptions`): the fed routing and everything of the
# experts' errors. The others are measured on every window.
FED_METRICS = frozenset(
    {
        "n_fed_tokens",
        "fed_windows",
        "worst_layer",
        "worst_layer_kind",
        "worst_layer_topk_overlap",
        "mean_topk_overlap",
        "mean_top1_agreement",
        "mean_mass_on_ref_experts",
        "mean_router_kl",
        "worst_expert",
        "worst_expert_rel_err",
        "worst_expert_cosine",
        "worst_expert_tokens",
        "worst_expert_measured_tokens",
        "median_expert_rel_err",
        "p90_expert_rel_err",
        "p99_expert_rel_err",
        "hurt_rel_err_floor",
        "experts_unmeasured",
        "experts_few_tokens",
        "experts_hurt",
        "hot_hurt_experts",
        "layers_with_hot_hurt",
        "worst_shared_expert_rel_err",
        "coverage_hot_hurt_below_floor",
    }
)
WORST_EXPERT_METRICS = (
    "worst_expert",
    "worst_expert_rel_err",
    "worst_expert_cosine",
    "worst_expert_tokens",
    "worst_expert_measured_tokens",
)
EVERY_WINDOW = "every"
FED = "fed"


@dataclass(frozen=True)
class MoeSample:
    """What the task's metrics were measured on: every window of the protocol (`tokens` routed per MoE
    layer), or the fed windows alone (`fed_tokens`)."""

    n_windows: int
    tokens: int
    fed_windows: list[int]
    fed_tokens: int

    def words(self, sample: str) -> str:
        """`on the fed windows 0, 7 of 8: 1,024 tokens per MoE layer`, or the same of every window."""
        if sample == FED:
            windows = ", ".join(str(w) for w in self.fed_windows)
            tokens = f"{self.fed_tokens:,} tokens per MoE layer"
            return f"on the fed windows {windows} of {self.n_windows}: {tokens}"
        return f"on every window ({self.n_windows}): {self.tokens:,} tokens per MoE layer"

    def describe(self, descriptions: Mapping[str, str]) -> dict[str, str]:
        """Each description, completed with the sample its metric was measured on."""
        return {
            name: f"{text} ({self.words(FED if name in FED_METRICS else EVERY_WINDOW)})"
            for name, text in descriptions.items()
        }

    def samples(self) -> dict[str, dict[str, Any]]:
        """The samples, for results.json's `identity`: their windows, tokens and words."""
        return {
            EVERY_WINDOW: {
                "windows": list(range(self.n_windows)),
                "tokens": self.tokens,
                "words": self.words(EVERY_WINDOW),
            },
            FED: {"windows": list(self.fed_windows), "tokens": self.fed_tokens, "words": self.words(FED)},
        }


class MoeCompareOptions(StrictModel):
    """How the comparison reads the observations (compare-only: changing it never invalidates one).

    An expert's error is judged only where it rests on at least `min_expert_tokens` measured tokens (tokens
    of the fed windows routed to it): the worst expert, the median and percentiles of the experts' errors and
    the hurt experts are taken among those, and the others are counted apart (`experts_few_tokens`). An
    expert is **hurt** when its weighted relative error exceeds both `hurt_min_rel_err` and `hurt_factor` ×
    the median error of those experts, and **hot** when the reference routes at least `hot_usage` × the
    uniform share of tokens to it (tokens × k / experts of its layer)."""

    hurt_factor: float = Field(2.0, gt=0)
    hurt_min_rel_err: float = Field(0.01, ge=0)
    hot_usage: float = Field(1.0, ge=0)
    # An expert's error from n tokens: a ratio of sums of n per-token squared errors, so its relative
    # standard error is about c / (2 √n), c the per-token coefficient of variation of the squared error; at
    # most about 1 / √(2n) (c = √2, one dominant direction). At 32 tokens that is 12.5%: an expert's error
    # known to about ±25% (two errors), enough to rank the worst and to tell twice the median from sampling
    # noise; below, one or two tokens with a large output can name an expert worst (docs/tasks/moe.md).
    min_expert_tokens: int = Field(32, ge=1)
    worst_experts: int = Field(10, ge=1)  # rows of the hot-and-hurt and the below-the-floor tables
    coverage_file: str = "calibration_coverage.json"  # in the candidate's folder, read when present
    coverage_floor: float = Field(32.0, ge=0)  # calibration tokens below which an expert is flagged


class MoeSpec(TaskSpec):
    protocol: WindowProtocol = WindowProtocol()
    fed: FedOptions = FedOptions()
    compare: MoeCompareOptions = MoeCompareOptions()


@task("moe")
class MixtureOfExperts:
    """Routing agreement per MoE layer, expert usage, per-expert damage and calibration coverage.

    Both sides run streamed, one after the other; the reference's observation is recordable."""

    spec_model: ClassVar[type[TaskSpec]] = MoeSpec
    metric_names: ClassVar[tuple[str, ...]] = (
        "n_moe_layers",
        "worst_layer",
        "worst_layer_topk_overlap",
        "mean_topk_overlap",
        "mean_top1_agreement",
        "mean_mass_on_ref_experts",
        "mean_router_kl",
        "own_mean_topk_overlap",
        "router_mean_topk_overlap",
        "worst_expert",
        "worst_expert_rel_err",
        "worst_expert_cosine",
        "worst_expert_measured_tokens",
        "experts_unused",
        "experts_unmeasured",
        "experts_few_tokens",
        "experts_hot",
        "experts_hurt",
        "hot_hurt_experts",
        "layers_with_hot_hurt",
        "median_expert_rel_err",
        "p90_expert_rel_err",
        "p99_expert_rel_err",
        "worst_shared_expert_rel_err",
        "coverage_below_floor",
        "coverage_hot_hurt_below_floor",
    )
    # Each description is completed, in results.json, with the windows and tokens the metric was measured on
    # (`MoeSample.describe`): the fed windows for those in `FED_METRICS`, every window for the others.
    metric_descriptions: ClassVar[dict[str, str]] = {
        "n_tokens": "tokens routed in each MoE layer, every window",
        "fed_windows": "the windows (of n_windows) the candidate's layers and experts were fed the "
        "reference's input on: the spec's [fed] windows",
        "n_fed_tokens": "tokens of the fed windows, routed in each MoE layer: the sample of the fed routing "
        "and of every expert error",
        "worst_layer": "the MoE layer whose router, fed the reference's input, shares the fewest top-k "
        "experts with the reference's (its decoder-layer index)",
        "worst_layer_topk_overlap": "that layer's mean |A∩B|/k: 1 when every token goes to the same experts",
        "mean_topk_overlap": "mean top-k set overlap |A∩B|/k over the tokens of every MoE layer, each "
        "candidate layer fed the reference's input to it",
        "mean_top1_agreement": "share of those tokens whose first expert is the reference's",
        "mean_mass_on_ref_experts": "the candidate's routing weight on the reference's chosen experts",
        "mean_router_kl": "mean KL(softmax(ref router logits) ‖ softmax(ckpt router logits))",
        "own_mean_topk_overlap": "mean top-k set overlap with the candidate on its own prefix: routing flips "
        "accumulated through the depth",
        "router_mean_topk_overlap": "mean top-k set overlap of the candidate's router alone on the "
        "reference's router input",
        "min_expert_tokens": "measured tokens an expert's error must rest on to be judged (the spec's "
        "[compare] min_expert_tokens): the worst expert, the error percentiles and the hurt experts are "
        "taken among those experts",
        "worst_expert": "the routed expert, of those with at least min_expert_tokens measured tokens, whose "
        "output on the tokens the reference routes to it is furthest from the reference expert's",
        "worst_expert_rel_err": "its relative output error ‖y_ckpt − y_ref‖ / ‖y_ref‖, weighted by the "
        "reference's routing weights",
        "worst_expert_cosine": "the cosine of its outputs with the reference expert's",
        "worst_expert_tokens": "tokens of the whole text (every window) the reference routes to it",
        "worst_expert_measured_tokens": "tokens its error rests on: those of the fed windows routed to it",
        "median_expert_rel_err": "median of the judged experts' weighted relative errors",
        "p90_expert_rel_err": "90th percentile of the judged experts' weighted relative errors (every "
        "expert's, with its tokens, is in moe_experts.csv)",
        "p99_expert_rel_err": "99th percentile of the judged experts' weighted relative errors",
        "hurt_rel_err_floor": "the error above which an expert is hurt: the larger of the spec's "
        "hurt_min_rel_err and hurt_factor × median_expert_rel_err",
        "experts_unused": "routed experts the reference sends no token of the text to (their damage is not "
        "measured)",
        "experts_unmeasured": "routed experts the text uses but the fed windows route no token to: their "
        "damage is not measured",
        "experts_few_tokens": "routed experts measured on fewer than min_expert_tokens tokens: counted "
        "apart, never named worst or hurt (their rows are in moe_experts.csv)",
        "experts_hot": "routed experts the reference sends at least the uniform share of its layer's "
        "tokens to (tokens × k / experts)",
        "experts_hurt": "experts with at least min_expert_tokens measured tokens whose error is above "
        "hurt_rel_err_floor",
        "hot_hurt_experts": "experts both hot (at least the uniform share of tokens) and hurt: quantization "
        "damage the text actually meets",
        "layers_with_hot_hurt": "MoE layers holding at least one hot and hurt expert",
        "worst_shared_expert_rel_err": "the largest relative output error of a shared expert, on every "
        "token routed",
        "coverage_below_floor": "experts with fewer calibration tokens than the spec's floor, by the pack's "
        "calibration coverage file",
        "coverage_hot_hurt_below_floor": "hot and hurt experts that are also below the calibration floor",
    }

    def __init__(self, spec: MoeSpec, context: RunContext) -> None:
        self.spec = spec
        self.context = context
        self.coverage_path: Path | None = None
        self.coverage: dict[tuple[int, int], float] | None = None

    def prepare(self, ref: Side, ckpt: Side) -> Inputs:
        """The `ppl` windows; a dense model is skipped; the candidate's calibration coverage file found."""
        for side in (ckpt, ref):
            if side.checkpoint is not None and expert_count(side.checkpoint.config) == 0:
                raise TaskSkipped(
                    f"the {side.role} model is dense: its config.json declares no routed experts "
                    f"({', '.join(EXPERT_COUNT_FIELDS)})"
                )
        if ckpt.checkpoint is not None:
            path = ckpt.checkpoint.path / self.spec.compare.coverage_file
            if path.is_file():
                config = ckpt.checkpoint.config
                depth = (config.get("text_config") or config).get("num_hidden_layers")
                layers = range(depth) if isinstance(depth, int) else range(0)
                self.coverage = read_coverage(path, layers, expert_count(config))
                self.coverage_path = path
        return prepare_windows(self.spec.protocol, self.context.corpus, ref, ckpt, self.context.shared)

    def needs(self) -> list[Need]:
        return [
            Need("ref", "ref", MoeReference(self.spec.protocol, self.spec.fed), streamed=True),
            Need(
                "ckpt",
                "ckpt",
                MoeErrors(self.spec.protocol, self.spec.fed),
                streamed=True,
                consumes=("ref",),
            ),
        ]

    def compare(self, observed: Mapping[str, Observation], artifacts: Path) -> TaskResult:
        """Routing per MoE layer, the experts' totals per layer and overall, the worst `worst_experts` by
        error × usage and of those below the calibration floor; every expert's row in moe_experts.csv and
        the layer × expert map in a plot. The report's size does not grow with the number of experts."""
        ref, ckpt = observed["ref"], observed["ckpt"]
        options = self.spec.compare
        moe_layers: list[int] = ref.meta["moe_layers"]
        kinds = ref.meta["layer_kinds"]
        routing, experts, shared = ckpt.arrays["routing"], ckpt.arrays["experts"], ckpt.arrays["shared"]
        usage = ref.arrays["usage"]
        summed = routing.sum(axis=2)  # (mode, layer, column)
        n_tokens = summed[..., 0]
        means = {
            mode: summed[m, :, 1:] / n_tokens[m, :, None] for m, mode in enumerate(MODES)
        }  # (layer, overlap/top1/mass/kl)
        fed = means["fed"]
        worst = int(np.argmin(fed[:, 0]))  # the first of equals
        every = summed.sum(axis=1)  # (mode, column)
        mean = {mode: every[m, 1:] / every[m, 0] for m, mode in enumerate(MODES)}

        with np.errstate(divide="ignore", invalid="ignore"):
            rel_err = np.where(experts[..., 3] == 0, 0.0, np.sqrt(experts[..., 3] / experts[..., 2]))
            cosine = experts[..., 5] / np.sqrt(experts[..., 2] * experts[..., 4])
        used = usage > 0
        # Errors exist for the experts the fed windows route tokens to (a subset of those the text uses),
        # and are judged where they rest on enough of them (`MoeCompareOptions.min_expert_tokens`).
        measured_tokens = experts[..., 0]
        measured = measured_tokens > 0
        enough = measured_tokens >= options.min_expert_tokens
        tokens_per_layer = usage.sum(axis=1, keepdims=True)
        uniform = tokens_per_layer / usage.shape[1]
        median = float(np.median(rel_err[enough])) if enough.any() else 0.0
        hurt_floor = max(options.hurt_min_rel_err, options.hurt_factor * median)
        hurt = enough & (rel_err > hurt_floor)
        hot = used & (usage >= options.hot_usage * uniform)
        score = rel_err * usage / tokens_per_layer  # error × share of the layer's routed tokens
        masked = np.where(enough, rel_err, -1.0)
        worst_slot, worst_e = np.unravel_index(int(np.argmax(masked)), masked.shape)

        coverage = self.coverage
        stray = sorted({layer for layer, _ in coverage or {}} - set(moe_layers))
        if stray:
            raise InputError(
                f"calibration coverage names layers {stray}, which hold no routed experts (MoE layers "
                f"{moe_layers})",
                self.coverage_path,
            )
        calibration = np.zeros(usage.shape)
        for (layer, e), count in (coverage or {}).items():
            calibration[moe_layers.index(layer), e] = count
        below = calibration < options.coverage_floor if coverage is not None else np.zeros_like(used)
        table = ExpertTable(
            moe_layers,
            usage,
            measured_tokens,
            enough,
            rel_err,
            cosine,
            hot,
            hurt,
            calibration if coverage is not None else None,
        )

        rows: list[dict[str, Any]] = []
        for s, layer in enumerate(moe_layers):
            sh = summed_errors(shared[s]) if shared[s, :, 0].sum() else None
            rows.append(
                {
                    "table": "routing per MoE layer (fed: the candidate's layer on the reference's input)",
                    "layer": layer,
                    "kind": kinds[layer],
                    "topk_overlap": float(fed[s, 0]),
                    "top1_agreement": float(fed[s, 1]),
                    "mass_on_ref_experts": float(fed[s, 2]),
                    "router_kl": float(fed[s, 3]),
                    "own_topk_overlap": float(means["own"][s, 0]),
                    "router_alone_topk_overlap": float(means["router"][s, 0]),
                    "experts_unused": int((~used[s]).sum()),
                    "shared_expert_rel_err": sh.relative_frobenius_error if sh else None,
                    "worst_expert": int(np.argmax(masked[s])) if enough[s].any() else None,
                    "worst_expert_rel_err": float(masked[s].max()) if enough[s].any() else None,
                }
            )
        rows += table.per_layer(below if coverage is not None else None)
        order = sorted(
            ((s, e) for s in range(len(moe_layers)) for e in range(usage.shape[1]) if enough[s, e]),
            key=lambda se: (-score[se], -rel_err[se]),
        )
        worst_rows = order[: options.worst_experts]
        title = "hot and hurt: the worst experts by error × usage"
        rows += [
            {"table": title, "rank": rank + 1, **table.row(s, e, below)}
            for rank, (s, e) in enumerate(worst_rows)
        ]
        if coverage is not None:
            # The experts below the floor that matter most first: hot and hurt, then hurt, then by tokens.
            flagged = sorted(
                zip(*np.nonzero(below), strict=True),
                key=lambda se: (-int(hot[se] and hurt[se]), -int(hurt[se]), -usage[se], se),
            )
            shown = flagged[: options.worst_experts]
            title = f"calibration coverage below {options.coverage_floor:g} tokens"
            if len(flagged) > len(shown):
                title += f": the {len(shown)} that matter most of {len(flagged):,}"
            rows += [{"table": title, **table.row(int(s), int(e), below)} for s, e in shown]
            if len(flagged) > len(shown):
                rows.append(
                    {"table": title, "expert": f"{len(flagged) - len(shown):,} more: see moe_experts.csv"}
                )
        shared_errors = [summed_errors(shared[s]).relative_frobenius_error for s in range(len(moe_layers))]
        quantiles = np.quantile(rel_err[enough], (0.9, 0.99)) if enough.any() else (0.0, 0.0)
        fed_windows: list[int] = ckpt.meta["fed_windows"]
        fed_tokens = int(n_tokens[MODES.index("fed"), 0])
        sample = MoeSample(ckpt.meta["n_windows"], int(n_tokens[0, 0]), fed_windows, fed_tokens)
        values: dict[str, Any] = {
            "corpus": ref.meta["corpus"],
            "n_windows": ckpt.meta["n_windows"],
            "n_tokens": sample.tokens,
            # the windows the fed routing and the experts' errors were measured on (the spec's [fed])
            "fed_windows": ", ".join(str(w) for w in fed_windows),
            "n_fed_tokens": sample.fed_tokens,
            "n_moe_layers": len(moe_layers),
            "n_experts": int(usage.size),
            "top_k": ref.meta["top_k"],
            "worst_layer": moe_layers[worst],
            "worst_layer_kind": kinds[moe_layers[worst]],
            "worst_layer_topk_overlap": float(fed[worst, 0]),
            "mean_topk_overlap": float(mean["fed"][0]),
            "mean_top1_agreement": float(mean["fed"][1]),
            "mean_mass_on_ref_experts": float(mean["fed"][2]),
            "mean_router_kl": float(mean["fed"][3]),
            "own_mean_topk_overlap": float(mean["own"][0]),
            "router_mean_topk_overlap": float(mean["router"][0]),
            "min_expert_tokens": options.min_expert_tokens,
            **dict.fromkeys(WORST_EXPERT_METRICS),
            "median_expert_rel_err": median,
            "p90_expert_rel_err": float(quantiles[0]),
            "p99_expert_rel_err": float(quantiles[1]),
            "hurt_rel_err_floor": hurt_floor,
            "experts_unused": int((~used).sum()),
            "experts_unmeasured": int((used & ~measured).sum()),
            "experts_few_tokens": int((measured & ~enough).sum()),
            "experts_hot": int(hot.sum()),
            "experts_hurt": int(hurt.sum()),
            "hot_hurt_experts": int((hot & hurt).sum()),
            "layers_with_hot_hurt": int((hot & hurt).any(axis=1).sum()),
            "worst_shared_expert_rel_err": float(max(shared_errors)) if ref.meta["shared_expert"] else None,
            "coverage_below_floor": int(below.sum()) if coverage is not None else None,
            "coverage_hot_hurt_below_floor": int((below & hot & hurt).sum())
            if coverage is not None
            else None,
            "ref_bytes_per_token": ref.meta["bytes_per_token"],
            "tokens_sha256": ckpt.meta["tokens_sha256"],
        }
        null_reasons = {}
        if enough.any():
            values.update(
                zip(
                    WORST_EXPERT_METRICS,
                    (
                        expert_name(moe_layers[int(worst_slot)], int(worst_e)),
                        float(rel_err[worst_slot, worst_e]),
                        float(cosine[worst_slot, worst_e]),
                        int(usage[worst_slot, worst_e]),
                        int(measured_tokens[worst_slot, worst_e]),
                    ),
                    strict=True,
                )
            )
        else:
            few = (
                f"no expert has {options.min_expert_tokens} measured tokens (the spec's min_expert_tokens) "
                f"on the fed windows {values['fed_windows']}"
            )
            null_reasons.update(dict.fromkeys(WORST_EXPERT_METRICS, few))
        if coverage is None:
            for name in ("coverage_below_floor", "coverage_hot_hurt_below_floor"):
                null_reasons[name] = f"the candidate ships no calibration coverage ({options.coverage_file})"
        measurable = frozenset(self.metric_names) - (set(null_reasons) | {"worst_shared_expert_rel_err"})
        checks, not_measured = self.spec.threshold_checks(values, measurable)
        made = {"experts": f"{artifacts.name}/moe_experts.csv"}
        if self.context.plots:
            plots.expert_heatmap(
                np.where(enough, rel_err, np.nan),
                moe_layers,
                artifacts / "moe_expert_rel_err.png",
                hurt_floor,
            )
            made["expert_rel_err"] = f"{artifacts.name}/moe_expert_rel_err.png"
        write_csv(artifacts / "moe_experts.csv", table.every_row(below))
        return TaskResult.from_checks(
            values,
            checks,
            details=rows,
            null_reasons=null_reasons,
            not_measured=not_measured,
            artifacts=made,
            descriptions=sample.describe(self.metric_descriptions),
            samples=sample.samples(),
            metric_samples=dict.fromkeys(sorted(FED_METRICS & values.keys()), FED),
        )
