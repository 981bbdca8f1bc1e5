"""Both checkpoints streamed tensor by tensor: every source tensor paired with what the candidate stores for
it, classified and measured, and the candidate's config checked against the rows."""

from __future__ import annotations

import dataclasses
import math
import multiprocessing
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from evalsuite.files.checkpoint import Checkpoint, TensorInfo
from evalsuite.formats import QuantizedFormat, ShardReader, one_torch_thread, rows_and_cols
from evalsuite.formats.compressed_tensors import INTEGER_FORMATS, CompressedTensors
from evalsuite.formats.exl3 import Exl3
from evalsuite.formats.exl3_decode import padded
from evalsuite.formats.fp8_block import METHOD as FP8_BLOCK_METHOD
from evalsuite.formats.fp8_block import Fp8BlockFormat
from evalsuite.formats.gptq import METHODS as GPTQ_METHODS
from evalsuite.formats.gptq import GptqFormat
from evalsuite.machine import usable_cores
from evalsuite.protocol.task import Progress, no_progress
from evalsuite.tasks.tensors._verification._compressed_tensors import CompressedTensorsVerifier, LibraryCheck
from evalsuite.tasks.tensors._verification._exl3 import Exl3Verifier
from evalsuite.tasks.tensors._verification._fp8_block import Fp8BlockVerifier
from evalsuite.tasks.tensors._verification._gguf import GgufVerifier
from evalsuite.tasks.tensors._verification._gptq import GptqVerifier
from evalsuite.tasks.tensors._verification._mlx import MlxFormat, MlxVerifier
from evalsuite.tasks.tensors._verification._modelopt import ModeloptFormat, ModeloptVerifier
from evalsuite.tasks.tensors._verification._modules import ModuleRules, layer_and_projection, skeleton_modules
from evalsuite.tasks.tensors._verification._mxfp4 import Mxfp4Format, Mxfp4Verifier
from evalsuite.tasks.tensors._verification._outliers import (
    channel_detail,
    is_sibling_outlier,
    sibling_detail,
    sibling_outliers,
)
from evalsuite.tasks.tensors._verification._pairing import Pair, pair_tensors, tied_head
from evalsuite.tasks.tensors._verification._rows import Problem, TensorRow, UnexpectedRow
from evalsuite.tasks.tensors._verification._same import compare_same

# A worker's unit of work: consecutive pairs, at most this many and about this many source bytes: a layer's
# small experts share a job (and the decodes of their sampled rows); the workers stay busy to the end.
JOB_PAIRS = 64
JOB_BYTES = 64 << 20


class FormatVerifier(Protocol):
    """How the candidate's quantized format is verified: what a quantized module's stored tensors say against
    its source weight, and what the config claims against every row."""

    # Whether its modules are measured in threads only: a decoder that cannot run in a forked process
    # (MLX's, once the parent has run MLX).
    threads_only: bool

    @property
    def format(self) -> QuantizedFormat:
        """The format whose stored tensors pair with the source's quantized modules."""
        ...

    def measure_many(
        self, modules: Sequence[tuple[TensorInfo, dict[str, TensorInfo], TensorRow]], reader: ShardReader
    ) -> list[list[Problem]]:
        """For each quantized module (its source weight, its stored tensors by parameter, its row): fill the
        row (format, bits, decode, error against the source weight) and return what its stored tensors get
        wrong. Several at once, so that a format may share the work of consecutive modules."""
        ...

    def check_config(self, rows: list[TensorRow]) -> tuple[list[Problem], dict[str, Any]]:
        """The config's claims against the tensors (every source tensor's row), and the claims themselves."""
        ...

    def before_fork(self) -> None:
        """Import what `measure_many` imports on first use, before the workers fork: each would import it
        again otherwise."""
        ...

    # What `measure_many` computed per module and `check_config` asks again (the config's word on each
    # module), kept by key: a forked worker's additions are sent back and merged into the parent's.
    module_matches: dict[Any, Any]


def format_verifier(candidate: Checkpoint, library_check: LibraryCheck = "sample") -> FormatVerifier | None:
    """How a candidate's quantized format is verified; None for a dense (unquantized) candidate.
    `library_check`: which rows a second decoder decodes too (`_compressed_tensors.library_runs`)."""
    if candidate.format == "compressed-tensors":
        return CompressedTensorsVerifier(
            CompressedTensors(candidate), skeleton_modules(candidate), library_check
        )
    if candidate.format == "exl3":
        return Exl3Verifier(Exl3(candidate))
    if candidate.format in GPTQ_METHODS:
        return GptqVerifier(GptqFormat(candidate))
    if candidate.format == FP8_BLOCK_METHOD:
        return Fp8BlockVerifier(Fp8BlockFormat(candidate))
    if candidate.format == "mxfp4":
        return Mxfp4Verifier(Mxfp4Format(candidate))
    if candidate.format == "mlx":
        return MlxVerifier(MlxFormat(candidate))
    if candidate.format == "modelopt":
        return ModeloptVerifier(ModeloptFormat(candidate))
    return None


@dataclass
class Verification:
    """What `verify_tensors` found: a row per source tensor (by name) and per unexpected candidate tensor,
    the problems (each naming its tensor), the config's claims, and the candidate's tensor bytes."""

    tensors: list[TensorRow]
    unexpected: list[UnexpectedRow]
    problems: list[Problem]
    claims: dict[str, Any]
    payload_bytes: int
    source_params: int
    library_check: LibraryCheck = "sample"

    @property
    def rows(self) -> list[dict[str, Any]]:
        """The rows of tensors.json: every source tensor, then every unexpected one."""
        return [row.to_json() for row in self.tensors] + [row.to_json() for row in self.unexpected]

    def summary(self) -> dict[str, Any]:
        """The counts and statistics of the rows, under the `tensors` task's metric names (None where a
        statistic has nothing to measure, e.g. no decoded tensor in an EXL3 candidate)."""
        source = self.tensors
        quantized = [r for r in source if r.tensor_class == "quantized"]
        protected = [r for r in source if r.tensor_class == "protected"]
        integer = [r for r in quantized if r.format in INTEGER_FORMATS]
        decoded = [r.decode_exact for r in quantized if r.decode_exact is not None]
        cross_checked = [r for r in quantized if r.library_checked_rows is not None]
        measured = [r for r in quantized if r.rel_err is not None]
        # A NaN error (a NaN code or scale decoded) is the worst of all, never passed over by max().
        worst = max(measured, key=lambda r: _nan_first(r.rel_err), default=None)
        worst_channel = max(measured, key=lambda r: _nan_first(r.worst_channel_rel_err), default=None)
        channel_err = [r for r in measured if r.worst_channel_err is not None]
        worst_err = max(channel_err, key=lambda r: _nan_first(r.worst_channel_err), default=None)
        gain_err = [r for r in measured if r.worst_channel_gain_err is not None]
        worst_gain = max(gain_err, key=lambda r: _nan_first(r.worst_channel_gain_err), default=None)
        backbone = [r for r in quantized if r.part == "text" and r.bits_per_weight is not None]
        backbone_numel = sum(_claimed_numel(r) for r in backbone)
        avg_bits = (
            sum(_claimed_numel(r) * r.bits_per_weight for r in backbone) / backbone_numel
            if backbone
            else None
        )
        values: dict[str, Any] = {
            "source_tensors": len(source),
            "protected_total": len(protected),
            "protected_identical": sum(1 for r in protected if r.identical),
            "quantized_int4": sum(1 for r in integer if r.bits == 4),
            "quantized_int8": sum(1 for r in integer if r.bits == 8),
            "quantized_other": len(quantized) - sum(1 for r in integer if r.bits in (4, 8)),
            "decode_exact": all(decoded) if decoded else None,
            **_cross_check_summary(cross_checked, self.library_check),
            "missing": sum(1 for r in source if r.tensor_class == "missing"),
            "unexpected": len(self.unexpected),
            "config_mismatches": sum(1 for p in self.problems if p.check == "config"),
            "payload_bytes": self.payload_bytes,
            "avg_bits_per_weight": avg_bits,
            "avg_bits_per_weight_all": 8 * self.payload_bytes / self.source_params
            if self.source_params
            else None,
            "worst_rel_err": worst.rel_err if worst else None,
            "worst_rel_err_tensor": worst.name if worst else None,
            "worst_channel_rel_err": worst_channel.worst_channel_rel_err if worst_channel else None,
            "worst_channel_rel_err_tensor": (
                f"{worst_channel.name} (output channel {worst_channel.worst_channel})"
                if worst_channel
                else None
            ),
            "worst_channel_err": worst_err.worst_channel_err if worst_err else None,
            "worst_channel_err_tensor": (
                f"{worst_err.name} (output channel {worst_err.worst_channel_err_channel})"
                if worst_err
                else None
            ),
            "worst_channel_gain_err": worst_gain.worst_channel_gain_err if worst_gain else None,
            "worst_channel_gain_err_tensor": (
                f"{worst_gain.name} (output channel {worst_gain.worst_channel_gain_err_channel})"
                if worst_gain
                else None
            ),
        }
        values.update(_outlier_summary(quantized))
        tiled = [r for r in quantized if r.worst_tile_ratio is not None]
        if tiled:
            worst_tile = max(tiled, key=lambda r: r.worst_tile_ratio)
            values["tile_outliers"] = sum(r.tile_outliers or 0 for r in tiled)
            values["worst_tile_ratio"] = worst_tile.worst_tile_ratio
            values["worst_tile_ratio_tensor"] = f"{worst_tile.name} (tile {worst_tile.worst_tile})"
        if "bits" in self.claims:
            claimed = self.claims["bits"]
            values["claimed_bits"] = claimed
            values["bpw_claim_error"] = abs(avg_bits - claimed) if avg_bits is not None else None
        return values


def _outlier_summary(quantized: list[TensorRow]) -> dict[str, Any]:
    """How many channels and tensors stand out from their siblings, and the most extreme of each (nothing
    where none was judged: a tensor of too few channels, a kind of too few tensors)."""
    values: dict[str, Any] = {}
    channels = [r for r in quantized if r.outlier_channels is not None]
    if channels:
        worst = max(channels, key=lambda r: r.worst_channel_z)
        values["outlier_channels"] = sum(r.outlier_channels for r in channels)
        values["worst_channel_z"] = worst.worst_channel_z
        values["worst_channel_z_tensor"] = f"{worst.name} (output channel {worst.worst_channel_z_channel})"
    tensors = [r for r in quantized if r.sibling_z is not None]
    if tensors:
        worst = max(tensors, key=lambda r: r.sibling_z)
        values["outlier_tensors"] = sum(
            1 for r in tensors if is_sibling_outlier(r.sibling_z, r.sibling_ratio)
        )
        values["worst_sibling_z"] = worst.sibling_z
        values["worst_sibling_z_tensor"] = worst.name
    return values


def sibling_key(row: TensorRow) -> tuple[Any, ...]:
    """What makes two quantized tensors siblings, judged against each other: the same part, projection,
    format and scheme (an expert's projection names no expert: the experts of every layer are siblings)."""
    stored = row.stored
    scheme = (
        (stored.type, stored.strategy, stored.group_size, stored.block, stored.symmetric) if stored else ()
    )
    return (row.part, row.projection, row.format, row.bits, row.strategy, scheme, row.codebook)


def outlier_problems(rows: Sequence[TensorRow]) -> list[Problem]:
    """The quantized tensors whose output channels stand out from each other (judged as each was measured),
    then those whose relative error stands out from their siblings' (judged here, filling each judged row's
    `sibling_z` and `sibling_ratio`): `_outliers`."""
    found = [
        Problem("outlier", r.name, channel_detail(r.channel_judgement, rows_and_cols(r.shape)[0]))
        for r in rows
        if r.channel_judgement is not None and r.channel_judgement.channels
    ]
    kinds: dict[tuple[Any, ...], list[TensorRow]] = {}
    for row in rows:
        if row.tensor_class == "quantized" and row.rel_err is not None:
            kinds.setdefault(sibling_key(row), []).append(row)
    for kind in kinds.values():
        judged = sibling_outliers([r.rel_err for r in kind])
        if judged is None:
            continue
        for row, z, ratio in zip(kind, judged.z, judged.ratio, strict=True):
            if math.isnan(z):
                continue
            row.sibling_z, row.sibling_ratio = float(z), float(ratio)
            if is_sibling_outlier(row.sibling_z, row.sibling_ratio):
                detail = sibling_detail(
                    row.rel_err, row.sibling_z, row.sibling_ratio, judged.median, row.projection, len(kind)
                )
                found.append(Problem("outlier", row.name, detail))
    return found


def _cross_check_summary(rows: list[TensorRow], check: LibraryCheck) -> dict[str, Any]:
    """What compressed-tensors' decompressor decoded beside evalsuite's decode of every row, over the rows of
    the weights both decode (nothing to say for an EXL3 candidate or a format only the library decodes)."""
    if not rows:
        return {}
    weights = sum(r.numel for r in rows)
    checked = sum(r.library_checked_rows * rows_and_cols(r.shape)[1] for r in rows)
    return {
        "decode_cross_check": check,
        "decode_cross_checked_tensors": sum(1 for r in rows if r.library_checked_rows),
        "decode_cross_checked_weights": checked,
        "decode_cross_checked_fraction": checked / weights if weights else None,
    }


def _claimed_numel(row: TensorRow) -> int:
    """The weight of a quantized row in the average bits per weight: its elements, or for an EXL3 Linear
    its padded elements, as exllamav3 weighs the `bits` it claims (`conversion/allocation.py:103-108`,
    `Linear.weights_numel` over the features padded to 128, `modules/linear.py:655-656`)."""
    if row.format == "exl3" and len(row.shape) == 2:
        return padded(row.shape[0]) * padded(row.shape[1])
    return row.numel


def _nan_first(value: float | None) -> float:
    return math.inf if value is None or math.isnan(value) else value


def _first_row(pair: Pair, info: TensorInfo, rules: ModuleRules) -> TensorRow:
    """A source tensor's row before it is measured: what its module is, classed missing."""
    part = rules.part(pair.module)
    layer, projection = layer_and_projection(pair.module, part)
    return TensorRow(
        name=pair.source,
        tensor_class="missing",
        module=pair.module,
        kind=rules.kind(pair.source, info.shape),
        part=part,
        layer=layer,
        projection=projection,
        dtype=info.dtype,
        shape=info.shape,
        numel=info.numel,
        candidate_tensors=sorted(pair.candidate.values()),
    )


def _measure_pairs(
    pairs: Sequence[Pair],
    source: Checkpoint,
    candidate: Checkpoint,
    verifier: FormatVerifier | None,
    rules: ModuleRules,
    reader: ShardReader,
) -> list[tuple[TensorRow, list[Problem]]]:
    """The row and the problems of each pair, in order; the quantized ones measured by the verifier
    together."""
    measured: list[tuple[TensorRow, list[Problem]]] = []
    quantized: list[tuple[int, TensorInfo, dict[str, TensorInfo], TensorRow]] = []
    for pair in pairs:
        info = source.tensors[pair.tied_to or pair.source]
        if pair.tied_to is not None:
            info = dataclasses.replace(info, name=pair.source)
        row = _first_row(pair, info, rules)
        problems: list[Problem] = []
        if pair.how == "same":
            casts = getattr(verifier, "protected_casts", None)
            problems = compare_same(info, candidate.tensors[pair.candidate[""]], reader, row, casts)
        elif pair.how == "quantized":
            assert verifier is not None  # only a candidate's format pairs a tensor as quantized
            row.tensor_class = "quantized"
            tensors = {param: candidate.tensors[name] for param, name in pair.candidate.items()}
            quantized.append((len(measured), info, tensors, row))
        else:
            problems = [Problem("missing", pair.source, "not in the candidate under any stored form")]
        measured.append((row, problems))
    if quantized:
        assert verifier is not None
        found = verifier.measure_many([(info, tensors, row) for _, info, tensors, row in quantized], reader)
        for (i, *_), problems in zip(quantized, found, strict=True):
            measured[i][1].extend(problems)
    for pair, (row, _) in zip(pairs, measured, strict=True):
        if pair.tied_to is not None:
            tied = f"tied to {pair.tied_to} in the source, stored apart in the candidate"
            row.note = f"{row.note}; {tied}" if row.note else tied
        row.payload_bytes = sum(candidate.tensors[n].nbytes for n in row.candidate_tensors)
    return measured


def _jobs(pairs: list[Pair], source: dict[str, TensorInfo]) -> Iterator[list[Pair]]:
    """Consecutive pairs in runs of at most JOB_PAIRS pairs and about JOB_BYTES source bytes: a worker's unit
    of work (a layer's experts, a few at a time, or one large tensor)."""
    job: list[Pair] = []
    size = 0
    for pair in pairs:
        nbytes = source[pair.tied_to or pair.source].nbytes
        if job and (len(job) == JOB_PAIRS or size + nbytes > JOB_BYTES):
            yield job
            job, size = [], 0
        job.append(pair)
        size += nbytes
    if job:
        yield job


# Workers: processes forked from this one (each its own GIL) or threads. A job is short numpy and torch calls
# with Python between them holding the GIL: on many small experts two threads measured no faster than one,
# two forked processes share only the page cache. Forking needs Linux; elsewhere, and for one worker, threads.
WorkerKind = Literal["process", "thread"]


def default_worker_kind(workers: int) -> WorkerKind:
    """Processes where there is more than one worker and this platform forks (Linux), else threads; threads
    too in a process that has initialised CUDA (a `compare` whose reference ran on a GPU): a child forked
    from it inherits a CUDA state it cannot use."""
    forks = sys.platform == "linux" and "fork" in multiprocessing.get_all_start_methods()
    torch = sys.modules.get("torch")
    cuda = torch is not None and torch.cuda.is_initialized()
    return "process" if workers > 1 and forks and not cuda else "thread"


Measured = list[tuple[TensorRow, list[Problem]]]


@dataclass(frozen=True)
class _Work:
    """What every job of one verification is measured against."""

    source: Checkpoint
    candidate: Checkpoint
    verifier: FormatVerifier | None
    rules: ModuleRules

    def measure(self, job: list[Pair], reader: ShardReader) -> Measured:
        return _measure_pairs(job, self.source, self.candidate, self.verifier, self.rules, reader)


def _measured_in_threads(jobs: list[list[Pair]], work: _Work, workers: int) -> Iterator[Measured]:
    """Each job's rows and problems, in job order, measured by `workers` threads of this process."""
    local, readers = threading.local(), []

    def measure(job: list[Pair]) -> Measured:
        reader = getattr(local, "reader", None)
        if reader is None:
            reader = local.reader = ShardReader()
            readers.append(reader)
        return work.measure(job, reader)

    try:
        with one_torch_thread(), ThreadPoolExecutor(workers, thread_name_prefix="tensors") as pool:
            yield from pool.map(measure, jobs)
    finally:
        for reader in readers:
            reader.__exit__()


# What forked workers inherit instead of receiving it pickled: set just before the pool forks, cleared after,
# under `_FORKING` (two verifications in two threads would fork each other's jobs).
_FORKED: dict[str, Any] = {}
_FORKING = threading.Lock()


def _measured_in_processes(jobs: list[list[Pair]], work: _Work, workers: int) -> Iterator[Measured]:
    """Each job's rows and problems, in job order, measured by `workers` processes forked from this one.

    The children inherit the checkpoints, the verifier and the jobs (nothing of them is pickled) and send back
    only rows, problems and the config matches they computed, which the parent's verifier keeps for
    `check_config` (matching is regular expressions in Python: milliseconds per module). What the verifier
    imports on first use it imports first (`FormatVerifier.before_fork`)."""
    if work.verifier is not None:
        work.verifier.before_fork()
    cache = work.verifier.module_matches if work.verifier is not None else {}
    with _FORKING:
        _FORKED.update(work=work, jobs=jobs)
        context = multiprocessing.get_context("fork")
        pool = ProcessPoolExecutor(workers, mp_context=context, initializer=_forked_worker)
        try:
            for measured, matched in pool.map(_forked_measure, range(len(jobs))):
                cache.update(matched)
                yield measured
        except BaseException:
            # An interrupt (or a failed job) stops the pool at the jobs running now, not after the rest.
            pool.shutdown(wait=True, cancel_futures=True)
            raise
        else:
            pool.shutdown(wait=True)
        finally:
            _FORKED.clear()


def _forked_worker() -> None:
    """A forked worker's start: one torch thread, its own reader, and an interrupt left to the parent (which
    stops the pool), so that Ctrl-C prints no traceback per child."""
    import torch

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(1)
    _FORKED["reader"] = ShardReader()


def _forked_measure(index: int) -> tuple[Measured, dict[Any, Any]]:
    """Job `index` measured in a forked worker, with the config matches it added to the verifier's cache."""
    work: _Work = _FORKED["work"]
    cache = work.verifier.module_matches if work.verifier is not None else {}
    before = set(cache)
    measured = work.measure(_FORKED["jobs"][index], _FORKED["reader"])
    return measured, {key: value for key, value in cache.items() if key not in before}


def verify_tensors(
    source: Checkpoint,
    candidate: Checkpoint,
    rules: ModuleRules,
    workers: int | None = None,
    library_check: LibraryCheck = "sample",
    worker_kind: WorkerKind | None = None,
    progress: Progress = no_progress,
) -> Verification:
    """Stream the source tensor by tensor (shard by shard, in file order) with the candidate tensors each one
    pairs with; classify and measure every pair, then check the candidate's config against the tensors.

    `workers` (default: the CPU count, at most 4) measure jobs of consecutive tensors (`_jobs`) at once, each
    with its own reader and buffers, so memory grows by a few blocks per worker (and the rows the library
    cross-checks, at most `LIBRARY_BATCH_ELEMENTS` per scheme), never by a tensor; `worker_kind` (default
    `default_worker_kind`) says whether they are forked processes or threads, which give the same rows.
    `library_check` says which rows of a compressed-tensors weight its library decodes too, beside
    evalsuite's decode of every row. `progress` is told of each job measured: at 31,000 tensors the pass
    takes minutes.
    """
    verifier = format_verifier(candidate, library_check)
    if candidate.format == "gguf":  # its tensors under the source's names, as the engine pairs them
        candidate = (verifier := GgufVerifier(source, candidate, library_check)).candidate
    pairs, unexpected = pair_tensors(
        source.tensors,
        candidate.tensors,
        verifier.format if verifier is not None else None,
        tied_head(source.tensors, source.config),
    )
    shard_order = {shard: i for i, shard in enumerate(source.shards)}
    # Source order: each shard read once, front to back.
    where = {name: (shard_order[info.shard], info.data_begin) for name, info in source.tensors.items()}
    pairs.sort(key=lambda p: where[p.tied_to or p.source])
    workers = workers or min(4, usable_cores())
    threads_only = verifier is not None and verifier.threads_only
    kind = worker_kind or ("thread" if threads_only else default_worker_kind(workers))
    rows: list[TensorRow] = []
    problems: list[Problem] = []
    measure = _measured_in_processes if kind == "process" else _measured_in_threads
    work = _Work(source, candidate, verifier, rules)
    jobs = list(_jobs(pairs, source.tensors))
    step = progress(f"tensors ({len(pairs):,} source tensors, in batches)", len(jobs))
    for measured in measure(jobs, work, workers):
        for row, found in measured:
            rows.append(row)
            problems += found
        step()
    rows.sort(key=lambda r: r.name)
    extra: list[UnexpectedRow] = []
    for name in unexpected:
        info = candidate.tensors[name]
        extra.append(UnexpectedRow(name, info.dtype, info.shape))
        problems.append(
            Problem("unexpected", name, f"{info.dtype} {list(info.shape)} pairs with no source tensor")
        )
    problems += outlier_problems(rows)
    claims: dict[str, Any] = {}
    if verifier is not None:
        config_problems, claims = verifier.check_config(rows)
        problems += config_problems
    by_tensor: dict[str, list[str]] = {}
    for problem in problems:
        by_tensor.setdefault(problem.tensor, []).append(f"{problem.check}: {problem.detail}")
    for row in [*rows, *extra]:
        row.problems = by_tensor.get(row.name, [])
    return Verification(
        tensors=rows,
        unexpected=extra,
        problems=problems,
        claims=claims,
        payload_bytes=sum(info.nbytes for info in candidate.tensors.values()),
        source_params=sum(info.numel for info in source.tensors.values()),
        library_check=library_check,
    )
