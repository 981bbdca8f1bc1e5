"""What was quantized, how well, and that nothing else changed: proved from the files of both checkpoints.

A file-only task: it streams the source and the candidate tensor by tensor (no model is built) through
`tensor_verification.verify_tensors`, then turns the rows into metrics, checks, `tensors.json` and a plot.
The files that are not tensors are compared too (`assets`: processor, tokenizer, chat template, generation
config), and a manifest the candidate ships (`SHA256SUMS`, `UPLOAD_MANIFEST.json`) is verified against it.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
from pydantic import Field

from evalsuite.backends.skeleton import ignored_on_load_patterns
from evalsuite.contract.spec import Check, StrictModel, TaskSpec
from evalsuite.errors import InputError
from evalsuite.files.checkpoint import SOURCE_FORMATS, Checkpoint
from evalsuite.files.digest import DigestCache
from evalsuite.files.manifest import ManifestCheck, find_manifests, read_manifest, verify_manifest
from evalsuite.files.run_folder import write_atomic, write_csv
from evalsuite.plotting import plots
from evalsuite.protocol.side import Side
from evalsuite.protocol.task import Inputs, Progress, RunContext, TaskResult, TaskSkipped, no_progress, task
from evalsuite.tasks.tensors._assets import AssetComparison, AssetRules, compare_assets
from evalsuite.tasks.tensors._verification import (
    LibraryCheck,
    ModuleRules,
    TensorRow,
    Verification,
    check_gguf_source,
    verify_tensors,
)


class CompareOptions(StrictModel):
    # metric → the metric it must equal (by name) or the literal it must equal
    equal: dict[str, str | bool | int] = Field(default_factory=dict)
    details_limit: int = Field(50, ge=0)  # problems listed in results.json; tensors.json lists them all
    worst_tensors: int = Field(10, ge=1)  # rows of the table of the worst tensors by relative error
    projections_limit: int = Field(40, ge=1)  # rows of the table of quantized tensors by projection


class DecodeOptions(StrictModel):
    # Which rows of a compressed-tensors weight its library's decompressor decodes beside evalsuite's decode
    # of every row: "sample" (a run of rows in every window of rows of each tensor) or "all".
    library_check: LibraryCheck = "sample"


class TensorsSpec(TaskSpec):
    modules: ModuleRules = ModuleRules()
    decode: DecodeOptions = DecodeOptions()
    assets: AssetRules = AssetRules()
    compare: CompareOptions = CompareOptions()


# Where a statistic that names no tensor is claimed.
WHERE = {"bpw_claim_error": "config.json: quantization_config.bits"}


def _failed(check: Check, values: dict[str, Any]) -> str:
    side = "above" if check.op == "<=" else "below"
    text = f"{check.name} = {check.value:.6g}, {side} its bound {check.threshold:g}"
    if check.name == "bpw_claim_error":
        measured = f"{values['avg_bits_per_weight']:.4f}"
        text += f": claims {values['claimed_bits']} bpw, the text backbone's trellises hold {measured} bpw"
    return text


def _architecture(config: dict[str, Any]) -> str:
    return ", ".join([*(config.get("architectures") or []), str(config.get("model_type"))])


def _vocab_size(config: dict[str, Any]) -> Any:
    return config.get("vocab_size", (config.get("text_config") or {}).get("vocab_size"))


@task("tensors")
class Tensors:
    """Each source tensor quantized, protected or missing; decoded, measured and checked with the config."""

    spec_model: ClassVar[type[TaskSpec]] = TensorsSpec
    metric_names: ClassVar[tuple[str, ...]] = (
        "source_tensors",
        "protected_total",
        "protected_identical",
        "quantized_int4",
        "quantized_int8",
        "quantized_other",
        "decode_exact",
        "decode_cross_check",
        "decode_cross_checked_tensors",
        "decode_cross_checked_weights",
        "decode_cross_checked_fraction",
        "missing",
        "unexpected",
        "config_mismatches",
        "payload_bytes",
        "avg_bits_per_weight",
        "avg_bits_per_weight_all",
        "worst_rel_err",
        "worst_channel_rel_err",
        "worst_channel_err",
        "worst_channel_gain_err",
        "bpw_claim_error",
        "tile_outliers",
        "worst_tile_ratio",
        "outlier_channels",
        "worst_channel_z",
        "outlier_tensors",
        "worst_sibling_z",
        "ignored_on_load_tensors",
        "ignored_on_load_bytes",
        "gguf_file_type",
        "gguf_tensor_types",
        "assets_compared",
        "assets_missing",
        "assets_changed",
        "asset_differences",
        "manifest_entries",
        "manifest_verified",
        "manifest_missing",
        "manifest_mismatched",
        "manifest_unlisted_weights",
    )

    metric_descriptions: ClassVar[dict[str, str]] = {
        "source_tensors": "tensors of the BF16 source, each classed as quantized, protected or missing (a "
        "head the source ties to the embedding counts again when the candidate stores it apart)",
        "protected_identical": "tensors kept unquantized whose bytes equal the source's (of protected_total)",
        "quantized_int4": "INT4 weights (compressed-tensors pack-quantized)",
        "quantized_int8": "INT8 weights (compressed-tensors int-quantized)",
        "quantized_other": "weights stored in another format (EXL3 trellises, another float dtype)",
        "decode_exact": "the format's second decoder (compressed-tensors' decompressor, Transformers' FP8 "
        "dequantization, llama.cpp's ggml decode) and the decode measured agree bit for bit on every row "
        "both decoded (decode_cross_check says which)",
        "decode_cross_check": "which rows the second decoder decoded beside the decode of every row: "
        "`sample` (16 consecutive rows in every 1,024 of each tensor, at least one run per tensor, placed "
        "by the tensor's name) or `all` (`[decode] library_check` in tasks/tensors.toml)",
        "decode_cross_checked_tensors": "tensors the library decoded rows of, beside evalsuite's decode",
        "decode_cross_checked_weights": "weights both decoded and compared bit for bit",
        "decode_cross_checked_fraction": "decode_cross_checked_weights over the weights evalsuite decoded "
        "(those of the formats both decode)",
        "missing": "source tensors absent from the candidate in any stored form",
        "unexpected": "candidate tensors that pair with no source tensor",
        "config_mismatches": "disagreements between quantization_config and what the files store",
        "assets_changed": "tokenizer and processor files of the source missing from the candidate or changed",
        "avg_bits_per_weight": "mean bits per weight of the quantized text-backbone Linear weights only",
        "avg_bits_per_weight_all": "8 × stored bytes / source parameters (embeddings and scales included)",
        "worst_rel_err": "relative Frobenius error of the worst decoded tensor against its source",
        "worst_channel_rel_err": "the same for the worst single output channel (above 1: further than zeros)",
        "worst_channel_err": "the worst output channel's error norm over the larger of its own norm and its "
        "tensor's RMS channel norm (bounded; holds for outlier channels, not for every GPTQ pack)",
        "worst_channel_gain_err": "the worst output channel's error component along the channel itself, over "
        "its norm times the larger of its norm and the tensor's RMS channel norm (reported: a wrong scale "
        "lies along the weights, and so does coarse rounding's shrinking of a channel)",
        "payload_bytes": "bytes of every tensor the candidate stores",
        "tile_outliers": "EXL3 16×16 tiles whose error in the rotated basis is an outlier against the median "
        "tile of their own tensor (a damaged trellis tile); for GGUF, ggml blocks against their tensor's "
        "median block (a damaged block scale or code)",
        "gguf_file_type": "GGUF: what general.file_type claims (checked against the type of most Linear "
        "weights)",
        "gguf_tensor_types": "GGUF: the file's tensors by ggml type (its per-tensor mix)",
        "worst_tile_ratio": "the largest tile error over its tensor's median tile error (EXL3)",
        "outlier_channels": "output channels of quantized tensors that decode further from their source than "
        "the tensor's other channels, by a robust z (median absolute deviation) and a ratio to the median "
        "channel (a damaged row, zero point or channel scale)",
        "worst_channel_z": "the largest robust z of a channel's error among its tensor's channels",
        "outlier_tensors": "quantized tensors whose relative error stands out from the tensors of their kind "
        "in the pack (same projection and scheme), by a robust z and a ratio to their median",
        "worst_sibling_z": "the largest robust z of a tensor's relative error among the tensors of its kind",
        "ignored_on_load_tensors": "candidate tensors its Transformers model class drops on load (an MTP "
        "head: `_keys_to_ignore_on_load_unexpected`), verified like the others",
        "ignored_on_load_bytes": "their bytes",
    }

    def __init__(self, spec: TensorsSpec, context: RunContext) -> None:
        self.spec = spec
        self.context = context

    def prepare(self, ref: Side, ckpt: Side) -> Inputs:
        """Refuse sides that are not a source and a candidate of the same model; skip a recorded reference."""
        if ref.is_recorded:
            raise TaskSkipped("the reference is a recording, which holds no tensors: pass the source folder")
        source, candidate = ref.checkpoint, ckpt.checkpoint
        if source.format not in SOURCE_FORMATS:
            raise InputError(f"the reference is {source.format}, not an unquantized source", source.path)
        checked = (("architecture", _architecture), ("vocabulary size", _vocab_size))
        if candidate.format == "gguf":  # no config.json: its header and metadata against the source's
            check_gguf_source(source, candidate)
            checked = ()
        for what, get in checked:
            a, b = get(source.config), get(candidate.config)
            if a != b:
                raise InputError(
                    f"its {what} ({b}) differs from the reference's ({a}): not a copy of that source",
                    candidate.path,
                )
        # A malformed manifest is bad input, refused before anything is streamed or loaded.
        manifests = [read_manifest(path) for path in find_manifests(candidate.path)]
        return {
            "source_fingerprint": source.fingerprint,
            "candidate_fingerprint": candidate.fingerprint,
            "manifests": manifests,
        }

    def compare_files(
        self,
        ref: Side,
        ckpt: Side,
        inputs: dict[str, Any],
        artifacts: Path,
        progress: Progress = no_progress,
    ) -> TaskResult:
        """Stream both checkpoints (a progress step per batch of tensors measured), then metrics, checks,
        tensors.json, tensors.csv and the error plot."""
        rules = self.spec.modules
        found = verify_tensors(
            ref.checkpoint,
            ckpt.checkpoint,
            rules,
            library_check=self.spec.decode.library_check,
            progress=progress,
        )
        values = found.summary()
        values.update(gguf_summary(found.claims))
        values.update(ignored_on_load_summary(ckpt.checkpoint))
        if ckpt.checkpoint.format == "gguf":  # the tokenizer is in its metadata: the assets are not measured
            assets = AssetComparison()
        else:
            assets = compare_assets(ref.checkpoint.path, ckpt.checkpoint.path, self.spec.assets)
            values.update(assets.summary())
        digests = self.context.digests or DigestCache.default()
        manifests = [verify_manifest(m, digests) for m in inputs.get("manifests", [])]
        values.update(manifest_summary(manifests))
        # A statistic the candidate's format has nothing to measure for (None or absent, e.g. decode_exact of
        # an EXL3 pack, bpw_claim_error without a bits claim) is listed as not measured, never passed.
        measured = frozenset(name for name, value in values.items() if value is not None)
        checks, unchecked = self.spec.threshold_checks(values, measurable=measured)
        for name, expected in self.spec.compare.equal.items():
            if values.get(name) is None:
                unchecked.append(name)
                continue
            want = values.get(expected) if isinstance(expected, str) else expected
            value = values.get(name)
            checks.append(Check(name=name, value=value, op="==", threshold=want, passed=value == want))
        if unchecked:
            values["not_measured"] = ", ".join(unchecked)  # e.g. no decoded tensor in an EXL3 candidate
        # A statistic over all tensors that fails names where it was measured, before the listed problems.
        details = [
            {
                "check": c.name,
                "tensor": WHERE.get(c.name) or values.get(f"{c.name}_tensor"),
                "detail": _failed(c, values),
            }
            for c in checks
            if not c.passed and (c.name in WHERE or f"{c.name}_tensor" in values)
        ]
        problems = [p.to_json() for p in found.problems]
        problems += [d.to_json() for d in assets.differences] + [r for m in manifests for r in m.problems()]
        details += problems[: self.spec.compare.details_limit]
        if len(problems) > self.spec.compare.details_limit:
            more = len(problems) - self.spec.compare.details_limit
            details.append({"check": "…", "tensor": f"{more:,} more", "detail": "see tensors.json"})
        options = self.spec.compare
        details += summary_tables(found.tensors, options.worst_tensors, options.projections_limit)
        artifact_paths = self.write(found, values, artifacts, assets, manifests)
        return TaskResult.from_checks(
            values, checks, artifacts=artifact_paths, details=details, not_measured=unchecked
        )

    def write(
        self,
        found: Verification,
        values: dict[str, Any],
        folder: Path,
        assets: AssetComparison,
        manifests: list[ManifestCheck],
    ) -> dict[str, str]:
        """tensors.json (every row, the problems, the assets and manifests, the summary), tensors.csv (every
        row, for a spreadsheet) and the error map; their paths relative to the run."""
        doc = {
            "schema": "evalsuite.tensors/1",
            "summary": values,
            "claims": found.claims,
            "problems": [p.to_json() for p in found.problems],
            "tensors": found.rows,
            "assets": {
                "compared": assets.compared,
                "differences": [d.to_json() for d in assets.differences],
            },
            "manifests": [
                {"file": m.manifest.file.name, "entries": len(m.manifest.entries), "problems": m.problems()}
                for m in manifests
            ],
        }
        write_atomic(folder / "tensors.json", _one_row_per_line(doc, "tensors") + "\n")
        write_csv(folder / "tensors.csv", doc["tensors"])
        made = {"tensors": f"{folder.name}/tensors.json", "tensors_table": f"{folder.name}/tensors.csv"}
        if self.context.plots:
            measured = [r for r in found.tensors if r.rel_err is not None]
            plots.relative_error_by_layer(
                [r.layer for r in measured],
                [r.projection for r in measured],
                [r.rel_err for r in measured],
                folder / "tensors_rel_err.png",
            )
            made["rel_err_map"] = f"{folder.name}/tensors_rel_err.png"
        return made


# Stands for the list of rows while the rest of tensors.json is written: no JSON text of a key or value
# holds a NUL unescaped, so its escaped form appears nowhere else.
_ROWS = "\0rows"


def _one_row_per_line(doc: dict[str, Any], key: str) -> str:
    """`doc` as JSON indented by one, with the list under `key` written one compact object per line: json
    writes indented text with its pure-Python encoder (0.3 s for the 3,177 rows of the 3 GB fixture) and
    compact text with its C encoder (a tenth of that)."""
    lines = ",\n".join(json.dumps(row, allow_nan=True) for row in doc[key])
    text = json.dumps({**doc, key: _ROWS}, indent=1, allow_nan=True)
    return text.replace(json.dumps(_ROWS), f"[\n{lines}\n ]" if lines else "[]", 1)


def ignored_on_load_summary(candidate: Checkpoint) -> dict[str, int]:
    """The candidate's tensors that its model class drops on load (an MTP head): how many and their bytes.
    They are verified like every tensor; a loaded model runs without them."""
    patterns = [re.compile(p) for p in ignored_on_load_patterns(candidate.config)]
    names = [n for n in candidate.tensors if any(p.search(n) for p in patterns)]
    return {
        "ignored_on_load_tensors": len(names),
        "ignored_on_load_bytes": sum(candidate.tensors[n].nbytes for n in names),
    }


def gguf_summary(claims: dict[str, Any]) -> dict[str, Any]:
    """A GGUF candidate's claimed file type and per-type tensor counts as metrics (none for other formats)."""
    if "tensor_types" not in claims:
        return {}
    types = ", ".join(f"{name} {count}" for name, count in claims["tensor_types"].items())
    return {"gguf_file_type": claims.get("file_type"), "gguf_tensor_types": types}


def manifest_summary(checks: list[ManifestCheck]) -> dict[str, Any]:
    """The manifests' metrics (none when the candidate ships no manifest: nothing was measured)."""
    if not checks:
        return {}
    return {
        "manifests": ", ".join(c.manifest.file.name for c in checks),
        "manifest_entries": sum(len(c.manifest.entries) for c in checks),
        "manifest_verified": sum(c.verified for c in checks),
        "manifest_missing": sum(len(c.missing) for c in checks),
        "manifest_mismatched": sum(len(c.mismatched) for c in checks),
        "manifest_unlisted_weights": sum(len(c.unlisted_weights) for c in checks),
    }


def _worst_first(value: float | None) -> float:
    """A relative error as a sort key, largest first: a NaN (a NaN code or scale decoded) is the worst there
    is, a tensor with none measured comes last."""
    if value is None:
        return math.inf
    return -math.inf if math.isnan(value) else -value


def _layer_span(layers: list[int | None]) -> str:
    """The decoder layers of a group of tensors: `0–39`, `3` or `—` outside the layer stacks."""
    numbered = sorted({layer for layer in layers if layer is not None})
    if not numbered:
        return "—"
    return str(numbered[0]) if len(numbered) == 1 else f"{numbered[0]}–{numbered[-1]}"


def summary_tables(rows: list[TensorRow], worst: int, projections: int) -> list[dict[str, Any]]:
    """What a person reads of tens of thousands of tensors (the report's detail rows, whatever the count):
    the source tensors of each part by class, the quantized tensors grouped by projection and scheme (the
    experts of every layer in one row, `projections` rows at most, the worst first) and the `worst` tensors
    by relative error. Every tensor's row is in tensors.csv and tensors.json."""
    out: list[dict[str, Any]] = []
    by_part: dict[str, list[TensorRow]] = {}
    for row in rows:
        by_part.setdefault(row.part, []).append(row)
    for part, members in by_part.items():
        counts = {
            c: sum(1 for r in members if r.tensor_class == c) for c in ("quantized", "protected", "missing")
        }
        out.append(
            {
                "table": "source tensors by part",
                "part": part,
                "tensors": len(members),
                **counts,
                "weights": sum(r.numel for r in members),
                "quantized_weights": sum(r.numel for r in members if r.tensor_class == "quantized"),
            }
        )
    quantized = [r for r in rows if r.tensor_class == "quantized"]
    groups: dict[tuple[Any, ...], list[TensorRow]] = {}
    for row in quantized:
        groups.setdefault((row.projection, row.format, row.bits, row.group), []).append(row)
    summaries = []
    for (projection, fmt, bits, group), members in groups.items():
        measured = [r for r in members if r.rel_err is not None]
        first = min(measured, key=lambda r: _worst_first(r.rel_err), default=None)
        errors = [r.rel_err for r in measured if r.rel_err is not None and not math.isnan(r.rel_err)]
        summaries.append(
            {
                "table": "quantized tensors by projection and scheme (the worst first)",
                "projection": projection,
                "format": fmt,
                "bits": bits,
                "group": group,
                "tensors": len(members),
                "layers": _layer_span([r.layer for r in members]),
                "weights": sum(r.numel for r in members),
                "median_rel_err": float(np.median(errors)) if errors else None,
                "worst_rel_err": first.rel_err if first else None,
                "worst_tensor": first.name if first else None,
            }
        )
    summaries.sort(key=lambda row: _worst_first(row["worst_rel_err"]))
    out += summaries[:projections]
    if len(summaries) > projections:
        out.append(
            {
                "table": summaries[0]["table"],
                "projection": f"{len(summaries) - projections:,} more: see tensors.csv",
            }
        )
    measured = sorted((r for r in quantized if r.rel_err is not None), key=lambda r: _worst_first(r.rel_err))
    title = (
        f"the worst quantized tensors by relative error ({min(worst, len(measured))} of {len(measured):,})"
    )
    out += [
        {
            "table": title,
            "tensor": r.name,
            "format": r.format,
            "bits": r.bits,
            "rel_err": r.rel_err,
            "sqnr_db": r.sqnr_db,
            "worst_channel": r.worst_channel,
            "worst_channel_rel_err": r.worst_channel_rel_err,
        }
        for r in measured[:worst]
    ]
    return out
