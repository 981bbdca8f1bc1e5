"""A checkpoint folder read as files: config.json, the safetensors index from headers alone, the format.

Nothing here loads a model. Every tensor's name, dtype, shape and byte range comes from the safetensors
headers, parsed and checked rather than trusted (`evalsuite.files.safetensors_headers`). Tensors are read one
at a time, so memory is bounded by the largest tensor.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any, Literal

from safetensors import safe_open

from evalsuite.errors import DependencyError, InputError
from evalsuite.files.identity import FileIdentity, check_unchanged
from evalsuite.files.mapped_tensors import MappedRead, check_little_endian, mapped_shard
from evalsuite.files.safetensors_headers import (
    DTYPE_SIZES,
    FLOAT_DTYPES,
    INDEX_FILE,
    TensorInfo,
    canonical_json,
    check_index_matches_headers,
    check_inside,
    hash_parts,
    read_header,
    read_index,
    read_json,
)

if TYPE_CHECKING:
    import torch

    from evalsuite.files.digest import DigestCache

# Names of `evalsuite.files.safetensors_headers` that callers have always imported from here.
__all__ = ["DTYPE_SIZES", "FLOAT_DTYPES", "INDEX_FILE", "Checkpoint", "CheckpointFormat", "TensorInfo"]

CheckpointFormat = Literal[
    "bf16",
    "fp16",
    "fp32",
    "compressed-tensors",
    "exl3",
    "gguf",
    "gptq",
    "awq",
    "fp8",
    "mlx",
    "mxfp4",
    "modelopt",
]

# The formats that store a model's tensors as floats, as they are: a source, never a quantized pack.
SOURCE_FORMATS: tuple[CheckpointFormat, ...] = ("bf16", "fp16", "fp32")

CONFIG_FILE = "config.json"
EXL3_CONFIG_FILE = "quantization_config.json"

# A GGUF file is not parsed here, so its fingerprint hashes its size and this much of its start (the
# metadata and tensor table come first in the format).
GGUF_FINGERPRINT_BYTES = 1 << 20

_FORMAT_OF_FLOAT_DTYPE: dict[str, CheckpointFormat] = {"BF16": "bf16", "F16": "fp16", "F32": "fp32"}
_QUANT_METHODS: dict[str, CheckpointFormat] = {
    "compressed-tensors": "compressed-tensors",
    "exl3": "exl3",
    "gptq": "gptq",
    "awq": "awq",
    "fp8": "fp8",
    "mxfp4": "mxfp4",
    "modelopt": "modelopt",
}

# Every file of a folder a tokenizer load may read, as glob patterns in the folder: two checkpoints whose such
# files are byte-identical tokenize alike, and the token cache (`evalsuite.files.run_cache`) is keyed by them.
# From Transformers 5.24's `PreTrainedTokenizerBase.from_pretrained`: the files every class reads beside its
# own (added_tokens.json and special_tokens_map.json among them: "kept only for legacy", but read), a
# versioned fast tokenizer file, the extra chat templates, the SentencePiece / tiktoken / tekken files it
# falls back to (any `*.model` in the folder); then every tokenizer class's `VOCAB_FILES_NAMES`. config.json,
# from which AutoTokenizer may pick the class, is keyed beside them where it matters. The first eight come
# first, in their old order: a folder holding only those keeps its hash. tests/unit/test_tokenizer_files.py
# checks the list against the installed Transformers.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "added_tokens.json",
    "tokenizer.*.json",
    "additional_chat_templates/*.jinja",
    "*.model",
    "tokenizer.model.*",
    "*tekken*.json",
    "*.tiktoken",
    "*.spm",
    "vocab.*",
    "vocab-*.json",
    "bpe.codes",
    "byte_maps.json",
    "dict.txt",
    "emoji.json",
    "entity_vocab.json",
    "normalizer.json",
    "prophetnet.tokenizer",
    "target_vocab.json",
    "word_pronunciation.json",
    "word_shape.json",
)
# Files of a checkpoint folder that say nothing about how the model computes: documentation, pictures,
# repository metadata, file manifests. Every other top-level file is part of the checkpoint's content.
_NOT_CONTENT = re.compile(
    r"(?i)^(readme|licen[cs]e|notice|copying|citation|use_policy)|\.(md|rst|png|jpe?g|gif|svg|webp|pdf)$|^\.git"
    r"|^(sha256sums(\.txt)?|upload_manifest\.json)$"
    # evalsuite's own fixture manifest records how a fixture was built, not what it computes: a rebuild that
    # writes the same weights (another recipe hash) must not invalidate observations.
    r"|^evalsuite-fixture\.json$"
)

_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")


@dataclass(frozen=True, eq=False)
class Checkpoint:
    """A checkpoint folder read as files; build one with `Checkpoint.open`.

    `tensors` holds every tensor of every shard, sorted by name; `shards` lists the safetensors files in a
    fixed order (sorted by their path in the folder). A GGUF checkpoint has no `tensors` and no `shards`:
    its one file is `gguf_file`. `fingerprint` is a sha256 over config.json's canonical JSON and each shard's
    name and raw header (not the tensor data), a cheap identity of the checkpoint. `total_bytes` is the size
    of the weight files on disk. `identities` holds each weight file's identity as its header was read
    (`evalsuite.files.identity`): every read of its bytes checks it, and `check_unchanged` checks them all.
    """

    path: Path
    config: dict[str, Any] = field(repr=False)
    format: CheckpointFormat
    tensors: dict[str, TensorInfo] = field(repr=False)
    shards: list[Path] = field(repr=False)
    gguf_file: Path | None
    fingerprint: str
    total_bytes: int
    identities: dict[Path, FileIdentity] = field(default_factory=dict, repr=False)

    @classmethod
    def open(cls, source: str | Path) -> Checkpoint:
        """Open a checkpoint folder, or a Hugging Face repo id ("org/name") already in the local cache.

        The hub is never contacted: the cache is the one `HF_HUB_CACHE` (or `HF_HOME`/hub) names when this
        is called. Raises `InputError` for a bad folder and `DependencyError` for a repo id not cached.
        """
        check_little_endian()
        path = Path(source).expanduser()
        if path.is_dir():
            return _open_folder(path.resolve(), extra_roots=())
        if path.exists():
            raise InputError("is not a folder (a checkpoint is a folder with config.json)", path)
        if isinstance(source, str) and _REPO_ID.fullmatch(source):
            snapshot = _cached_snapshot(source)
            # The cache stores files as symlinks from snapshots/<rev>/ into the repo's blobs/ folder.
            return _open_folder(snapshot, extra_roots=((snapshot.parent.parent / "blobs").resolve(),))
        raise InputError("does not exist", path)

    @property
    def model_type(self) -> str | None:
        """config.json's `model_type`, or None when absent."""
        value = self.config.get("model_type")
        return value if isinstance(value, str) else None

    @property
    def quantization_config(self) -> dict[str, Any] | None:
        """config.json's `quantization_config`, or None when absent."""
        return self.config.get("quantization_config")

    def file(self, name: str) -> Path:
        """A file inside the checkpoint folder (e.g. "tokenizer.json"); `InputError` if it is missing."""
        pure = PurePosixPath(name)
        if not name or pure.is_absolute() or ".." in pure.parts:
            raise InputError(f"{name!r} is not a file name inside the checkpoint", self.path)
        path = self.path / pure
        if not path.is_file():
            raise InputError("missing from the checkpoint folder", path)
        return path

    def content_files(self) -> list[Path]:
        """Every top-level file of the folder that can change what the model computes or how it tokenizes:
        weights, configs, tokenizer, processor, chat template, code; not documentation. Sorted by name."""
        files = {p for p in self.path.iterdir() if p.is_file() and not _NOT_CONTENT.search(p.name)}
        # Shards may live in sub-folders of the index; they are content too.
        files.update(self.shards)
        if self.gguf_file is not None:
            files.add(self.gguf_file)
        return sorted(files, key=lambda p: p.relative_to(self.path).as_posix())

    def content_sha256(self, cache: DigestCache | None = None) -> str:
        """A digest of every byte of `content_files()` (names and bytes): the identity of what a backend
        reads. Streams every file once; `cache` skips files unchanged since they were last hashed."""
        from evalsuite.files.digest import DigestCache

        cache = cache or DigestCache()
        files = self.content_files()
        digests = cache.sha256_many(files)
        hasher = hashlib.sha256()
        for path in files:
            hash_parts(hasher, path.relative_to(self.path).as_posix().encode(), digests[path].encode())
        return hasher.hexdigest()

    @property
    def tokenizer_sha256(self) -> str:
        """Hash of the tokenizer files present in the folder (`tokenizer_files`: names and bytes)."""
        digest = hashlib.sha256()
        for path in self.tokenizer_files():
            name = path.relative_to(self.path).as_posix()
            digest.update(name.encode() + b"\0" + hashlib.sha256(path.read_bytes()).digest())
        return digest.hexdigest()

    def tokenizer_files(self) -> list[Path]:
        """The files of the folder a tokenizer load may read (`TOKENIZER_FILES`), each once, in that order."""
        found: dict[Path, None] = {}
        for pattern in TOKENIZER_FILES:
            for path in sorted(self.path.glob(pattern)):
                if path.is_file():
                    found.setdefault(path, None)
        return list(found)

    def load_tokenizer(self, *, trust_remote_code: bool = False) -> Any:
        """The checkpoint's own tokenizer, read from its files by Transformers (no model)."""
        from transformers import AutoTokenizer

        kwargs: dict[str, Any] = {"trust_remote_code": trust_remote_code}
        if self.gguf_file is not None:
            kwargs["gguf_file"] = self.gguf_file.name
        try:
            return AutoTokenizer.from_pretrained(str(self.path), **kwargs)
        except Exception as exc:
            text = str(exc).strip()
            msg = text.splitlines()[0] if text else type(exc).__name__
            raise InputError(f"cannot load the tokenizer: {msg}", self.path) from None

    def check_unchanged(self) -> None:
        """Raise `FileChangedError` (exit 2, naming it) where a weight file is no longer the one whose header
        was read: replaced, rewritten or cut short since the checkpoint was opened."""
        for path, identity in self.identities.items():
            check_unchanged(path, identity)

    def read_tensor(self, name: str) -> torch.Tensor:
        """Read one tensor (a CPU copy) through safetensors."""
        info = self._info(name)
        with self._reading(info.shard), safe_open(info.shard, framework="pt", backend="pread") as f:
            return f.get_tensor(name)

    def iter_tensors(self, names: Iterable[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield `(name, tensor)` for `names` (default: all, each once), shard by shard in file order.

        Each shard is opened once, and only one tensor is held at a time on this side. Unknown names are
        rejected before anything is read.
        """
        infos = self.tensors.values() if names is None else {self._info(n) for n in names}
        by_shard: dict[Path, list[TensorInfo]] = {}
        for info in sorted(infos, key=lambda i: i.data_begin):
            by_shard.setdefault(info.shard, []).append(info)
        return self._stream(by_shard)

    def _stream(self, by_shard: dict[Path, list[TensorInfo]]) -> Iterator[tuple[str, torch.Tensor]]:
        for shard in self.shards:
            if shard not in by_shard:
                continue
            with self._reading(shard), safe_open(shard, framework="pt", backend="pread") as f:
                for info in by_shard[shard]:
                    yield info.name, f.get_tensor(info.name)

    @contextlib.contextmanager
    def _reading(self, shard: Path) -> Iterator[None]:
        # Read by safetensors (by `pread`: a file cut short under it is an error, never a SIGBUS), between two
        # checks of the file's identity: what was read is the file whose header was checked, or the read is
        # refused. A read that fails because the file changed under it says so, not what failed.
        identity = self.identities.get(shard)
        if identity is not None:
            check_unchanged(shard, identity)
        try:
            yield
        except Exception:
            if identity is not None:
                check_unchanged(shard, identity)
            raise
        if identity is not None:
            check_unchanged(shard, identity)

    @contextlib.contextmanager
    def open_tensors(self, names: Iterable[str]) -> Iterator[dict[str, MappedRead]]:
        """Lazy handles of `names` for the duration of the block, as Transformers' own loader takes
        safetensors slices: a whole read (`handle[...]`) is a view of the shard's private mapping whose pages
        are handed back when the tensor is freed (`evalsuite.files.mapped_tensors`), one mapping per shard
        however many tensors it holds. Only the shards holding `names` are mapped, each checked to be the file
        whose header was read. Unknown names are rejected before anything is opened."""
        infos = [self._info(n) for n in names]
        mappings = {}
        for shard in dict.fromkeys(info.shard for info in infos):
            mappings[shard] = mapped_shard(shard, self._identity(shard))
        yield {info.name: MappedRead(mappings[info.shard], info) for info in infos}

    def read_bytes(self, name: str) -> bytes:
        """The tensor's data exactly as stored in its shard."""
        info = self._info(name)
        with info.shard.open("rb") as f:
            check_unchanged(info.shard, self._identity(info.shard), os.fstat(f.fileno()))
            f.seek(info.data_begin)
            data = f.read(info.nbytes)
        if len(data) != info.nbytes:
            raise InputError(f"truncated shard: tensor {name!r} ends past the end of the file", info.shard)
        return data

    def _identity(self, shard: Path) -> FileIdentity:
        identity = self.identities.get(shard)
        if identity is None:  # a Checkpoint built by hand, without identities: the file as it is now
            identity = FileIdentity.of(os.stat(shard))
        return identity

    def _info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise InputError(f"no tensor named {name!r} in this checkpoint", self.path) from None


def _hub_cache_dir() -> Path:
    # huggingface_hub reads these variables once, at import; a caller (or a test) that sets them later
    # still means them.
    if cache := os.environ.get("HF_HUB_CACHE"):
        return Path(cache)
    if home := os.environ.get("HF_HOME"):
        return Path(home) / "hub"
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def _cached_snapshot(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        folder = snapshot_download(repo_id, cache_dir=_hub_cache_dir(), local_files_only=True)
    except (LocalEntryNotFoundError, HFValidationError):
        raise DependencyError(
            f"{repo_id} is not a folder and not in the local Hugging Face cache (no network)"
        ) from None
    return Path(folder).resolve()


def _open_folder(folder: Path, extra_roots: tuple[Path, ...]) -> Checkpoint:
    roots = (folder, *extra_roots)
    index_path = folder / INDEX_FILE
    has_index = index_path.is_file()
    loose = [] if has_index else sorted(p for p in folder.glob("*.safetensors") if p.is_file())
    ggufs = [] if has_index or loose else sorted(p for p in folder.glob("*.gguf") if p.is_file())

    config_path = folder / CONFIG_FILE
    if config_path.is_file():
        config = read_json(config_path)
        if not isinstance(config, dict):
            raise InputError("config.json is not a JSON object", config_path)
    elif ggufs:
        config = {}  # a GGUF file carries its own configuration in its metadata
    else:
        raise InputError("no config.json in this folder (not a Hugging Face checkpoint)", folder)
    qc = config.get("quantization_config")
    if qc is not None and not isinstance(qc, dict):
        raise InputError("quantization_config is not a JSON object", config_path)

    weight_map: dict[str, str] | None = None
    if has_index:
        weight_map, shards = read_index(index_path, folder, roots)
    else:
        for shard in loose:
            check_inside(shard, roots)
        shards = loose
    if not shards and not ggufs:
        raise InputError("no weights: no model.safetensors.index.json, *.safetensors or *.gguf file", folder)

    fingerprint = hashlib.sha256()
    hash_parts(fingerprint, b"config.json", canonical_json(config))
    tensors: dict[str, TensorInfo] = {}
    total_bytes = 0
    identities: dict[Path, FileIdentity] = {}
    for shard in shards:
        raw_header, infos, identity = read_header(shard)
        hash_parts(fingerprint, shard.relative_to(folder).as_posix().encode(), raw_header)
        identities[shard] = identity
        total_bytes += identity.size
        for info in infos:
            if (first := tensors.get(info.name)) is not None:
                raise InputError(f"tensor {info.name!r} is also stored in {first.shard.name}", shard)
            tensors[info.name] = info
    if weight_map is not None:
        check_index_matches_headers(index_path, folder, weight_map, tensors)

    gguf_file = None
    if ggufs:
        if len(ggufs) > 1:
            names = ", ".join(p.name for p in ggufs)
            raise InputError(f"several .gguf files ({names}): pass a folder with one", folder)
        gguf_file = ggufs[0]
        check_inside(gguf_file, roots)
        with gguf_file.open("rb") as f:
            identities[gguf_file] = FileIdentity.of(os.fstat(f.fileno()))
            head = f.read(GGUF_FINGERPRINT_BYTES)
        total_bytes = identities[gguf_file].size
        hash_parts(fingerprint, gguf_file.name.encode(), str(total_bytes).encode(), head)

    return Checkpoint(
        path=folder,
        config=config,
        format=_detect_format(folder, config, tensors, gguf_file),
        tensors=dict(sorted(tensors.items())),
        shards=shards,
        gguf_file=gguf_file,
        fingerprint=fingerprint.hexdigest(),
        total_bytes=total_bytes,
        identities=identities,
    )


def _detect_format(
    folder: Path, config: dict[str, Any], tensors: dict[str, TensorInfo], gguf_file: Path | None
) -> CheckpointFormat:
    if gguf_file is not None:
        return "gguf"
    method = (config.get("quantization_config") or {}).get("quant_method")
    if method is None and _is_mlx(config):
        return "mlx"
    if method is None and _is_exl3_storage(folder / EXL3_CONFIG_FILE):
        method = "exl3"
    if method is None and _is_modelopt_export(folder / "hf_quant_config.json"):
        method = "modelopt"  # ModelOpt's older exports say so only beside config.json
    if method is not None:
        if not isinstance(method, str) or method not in _QUANT_METHODS:
            raise InputError(
                f"quantization_config.quant_method {method!r} is not supported "
                f"(known: {', '.join(_QUANT_METHODS)})",
                folder / CONFIG_FILE,
            )
        return _QUANT_METHODS[method]
    numel_by_dtype: dict[str, int] = {}
    for info in tensors.values():
        if info.dtype in FLOAT_DTYPES:
            numel_by_dtype[info.dtype] = numel_by_dtype.get(info.dtype, 0) + info.numel
    if not numel_by_dtype:
        raise InputError(
            "cannot tell the format: no floating-point tensor and no quantization_config", folder
        )
    # Ties broken by name so that the answer never depends on dict order.
    dominant = max(numel_by_dtype, key=lambda d: (numel_by_dtype[d], d))
    if dominant not in _FORMAT_OF_FLOAT_DTYPE:
        raise InputError(
            f"cannot tell the format: most floating-point weights are {dominant} "
            f"(known: {', '.join(_FORMAT_OF_FLOAT_DTYPE)}) and there is no quantization_config",
            folder,
        )
    return _FORMAT_OF_FLOAT_DTYPE[dominant]


def mlx_quantization(config: dict[str, Any]) -> dict[str, Any] | None:
    """config.json's `quantization` when it is mlx-lm's (a `group_size` and a `bits`; `evalsuite.formats.mlx`
    reads the rest), else None."""
    q = config.get("quantization")
    if isinstance(q, dict) and isinstance(q.get("group_size"), int) and isinstance(q.get("bits"), int):
        return q
    return None


def _is_modelopt_export(path: Path) -> bool:
    """Whether `path` is ModelOpt's hf_quant_config.json (its `producer` named `modelopt`)."""
    if not path.is_file():
        return False
    content = read_json(path)
    producer = content.get("producer") if isinstance(content, dict) else None
    return isinstance(producer, dict) and producer.get("name") == "modelopt"


def _is_mlx(config: dict[str, Any]) -> bool:
    return mlx_quantization(config) is not None


def _is_exl3_storage(path: Path) -> bool:
    """Whether this is exllamav3's quantization_config.json (quantization_config plus tensor_storage)."""
    if not path.is_file():
        return False
    content = read_json(path)
    if not isinstance(content, dict):
        return False
    storage = content.get("tensor_storage")
    modules = storage.values() if isinstance(storage, dict) else ()
    return content.get("quant_method") == "exl3" or any(
        isinstance(m, dict) and m.get("quant_format") == "exl3" for m in modules
    )
