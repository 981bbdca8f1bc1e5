"""`llamacpp`: a GGUF file run by llama.cpp's own arithmetic, through the prebuilt CPU wheel of xllamacpp.

What llama.cpp runs: the whole decoder, each window as one batch of its tokens with causal attention, as
`llama-perplexity` evaluates a chunk (the prompt path: its quantized-activation dot products, its f16 KV
cache), up to the final norm. The binding exposes no logits: what it gives for every position of a batch
is the final norm's output (its server's `/embedding` endpoint with pooling `none`). What evalsuite runs:
the head on those states, in float32, with the file's output weight (or the tied embedding) dequantized by
the `gguf` package. So this side's KLD against the same file under Transformers measures llama.cpp's body,
not its head's matmul, and `describe()` says so in every report.

Why not the completion endpoint, which does apply llama.cpp's head: it gives log-probabilities only for the
position it generates (one request per scored position, on the token-by-token decode path, whose numbers
differ from the batch path's), and only the top `n_probs`: the whole vocabulary per position is a JSON
document of every token's text, several times the cost of the forward behind it.

Generation (`smoke`, `vision`) is not offered: llama.cpp's completion endpoint generates greedily from token
ids, but it folds the log-probabilities of a token that ends inside a UTF-8 character into the next token's
(a Chinese answer loses the top-k of half its steps), and `smoke` compares every step's top-k. Those tasks
are skipped on this backend with that reason (`NO_GENERATION`).

Why HTTP at all: the binding's in-process call, `Server.handle_embeddings`, is the OpenAI-style route, which
refuses pooling `none` (it has no per-position states); only the server's own `/embedding` route gives them.
So the server listens for as long as the side is loaded, on a loopback port the system picks (port 0: never
one another run or service holds, so runs at once each have their own), its routes under a path and behind
an API key both drawn at random for it. It is asked through an opener that ignores the proxy settings
(`http_proxy` would otherwise carry the token ids to the proxy and its answer back as states), and before
the first window it is checked to be the server this side started: under its secret path, its `/props` names
this file. Nothing else is reached. A window's token ids are sent as they are (no BOS added): the count of
states returned is checked against the window.
"""

from __future__ import annotations

import functools
import json
import secrets
import urllib.error
import urllib.request
from collections.abc import Iterator
from importlib.metadata import version
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from evalsuite.errors import DependencyError, InputError
from evalsuite.machine import usable_cores

if TYPE_CHECKING:
    from evalsuite.backends.options import BackendOptions
    from evalsuite.files.checkpoint import Checkpoint

BACKEND = "llamacpp"
# The GGUF tensors a head can be: llama.cpp's converter writes `output.weight` unless the model ties it.
HEAD_TENSORS = ("output.weight", "token_embd.weight")
# Metadata of the architectures whose logits llama.cpp transforms after the head (Gemma 2's soft-capping,
# Cohere's and Granite's scales).
HEAD_TRANSFORMS = (".final_logit_softcapping", ".logit_scale", ".logits_scaling")
INSTALL_HINT = "pip install 'evalsuite[llamacpp]'"
# Requests to the side's own server: no proxy handler, whatever http_proxy and its kin say.
LOOPBACK = urllib.request.build_opener(urllib.request.ProxyHandler({}))
NO_GENERATION = (
    "backend llamacpp does not generate: llama.cpp's server folds the top-k log-probs of a token that ends "
    "inside a UTF-8 character into the next token's"
)


def check_llamacpp_load_plan(checkpoint: Checkpoint, options: BackendOptions) -> None:
    """Refuse, before anything loads, what this backend cannot run: a checkpoint that is no GGUF file, a
    device other than the CPU (the wheel is llama.cpp's CPU build), `--stream` (llama.cpp maps the file
    itself), or a machine without xllamacpp."""
    if checkpoint.format != "gguf" or checkpoint.gguf_file is None:
        raise InputError(
            f"backend {BACKEND} runs GGUF files; this checkpoint is {checkpoint.format}", checkpoint.path
        )
    if options.device != "cpu":
        raise InputError(f"backend {BACKEND} runs on the CPU (xllamacpp's CPU wheel), not {options.device}")
    if options.stream:
        raise InputError(f"backend {BACKEND} is not streamed: llama.cpp maps the GGUF file itself")
    _xllamacpp()


def _xllamacpp() -> Any:
    try:
        import xllamacpp
    except ImportError:
        raise DependencyError(f"backend {BACKEND} needs xllamacpp: {INSTALL_HINT}") from None
    return xllamacpp


def head_weight(checkpoint: Checkpoint) -> tuple[str, str, np.ndarray]:
    """(tensor name, ggml type, float32 (vocab, hidden) weight) of the file's head: `output.weight`, else
    the embedding it is tied to, dequantized by the `gguf` package."""
    from evalsuite.formats.gguf import decode_rows, read_gguf, row_bytes

    assert checkpoint.gguf_file is not None
    gguf_file = read_gguf(checkpoint.gguf_file)
    tensors = {t.name: t for t in gguf_file.tensors}
    name = next((n for n in HEAD_TENSORS if n in tensors), None)
    if name is None:
        raise InputError(f"no head in the file: neither {' nor '.join(HEAD_TENSORS)}", checkpoint.gguf_file)
    # llama.cpp applies these after the head's matmul: a head evalsuite would apply without them is not
    # the file's, so such a file is refused rather than scored with a plain matmul.
    extra = [k for k in gguf_file.metadata if k.endswith(HEAD_TRANSFORMS)] + [
        n for n in tensors if n.startswith("output.") and n != "output.weight"
    ]
    if extra:
        raise InputError(
            f"its head has more than a matmul ({', '.join(sorted(extra))}), which backend {BACKEND} does not "
            "apply; use --backend hf",
            checkpoint.gguf_file,
        )
    tensor = tensors[name]
    if len(tensor.shape) != 2:
        raise InputError(f"{name} has shape {tensor.shape}, not (vocab, hidden)", checkpoint.gguf_file)
    rows, cols = tensor.shape
    raw = np.fromfile(
        checkpoint.gguf_file,
        dtype=np.uint8,
        count=tensor.data_end - tensor.data_begin,
        offset=tensor.data_begin,
    ).reshape(rows, row_bytes(tensor.type_name, cols))
    return name, tensor.type_name, decode_rows(raw, tensor.type_name, cols)


class LlamaCppBackend:
    """A GGUF file under llama.cpp (module docstring): windows scored; generation and images refused."""

    def __init__(self, checkpoint: Checkpoint, options: BackendOptions) -> None:
        check_llamacpp_load_plan(checkpoint, options)
        self.checkpoint, self.options = checkpoint, options
        self.head_name, self.head_type, weight = head_weight(checkpoint)
        self.head = torch.from_numpy(weight)
        self.vocab_size = int(self.head.shape[0])
        self._server: Any = None
        self._context = 0  # the running server's context, in tokens
        self._base = ""  # the running server's address and secret path
        self._key = ""  # its API key

    @functools.cached_property
    def tokenizer(self) -> Any:
        """The file's tokenizer as Transformers reads it (the windows come tokenized: only tasks that
        tokenize text ask)."""
        return self.checkpoint.load_tokenizer(trust_remote_code=self.options.trust_remote_code)

    def describe(self) -> dict[str, Any]:
        """llama.cpp's execution, and the part evalsuite runs (the head)."""
        build = _xllamacpp().BUILD_INFO
        return {
            "backend": BACKEND,
            "execution": (
                f"llama.cpp (xllamacpp {version('xllamacpp')}, {build['build_target']}) runs the decoder on "
                f"the CPU, each window one batch; the head ({self.head_name}, {self.head_type}) applied by "
                "evalsuite in float32 to llama.cpp's final-norm states, its weight dequantized by the gguf "
                "package"
            ),
            "format": "gguf",
        }

    def _started(self, tokens: int) -> Any:
        """The server, with a context and a batch that hold a window of `tokens` in one batch."""
        if self._server is not None and self._context >= tokens:
            return self._server
        self._stop()
        xllamacpp = _xllamacpp()
        params = xllamacpp.CommonParams()
        assert self.checkpoint.gguf_file is not None
        params.model.path = str(self.checkpoint.gguf_file)
        params.n_ctx = params.n_batch = params.n_ubatch = tokens
        params.n_parallel = 1
        threads = usable_cores()
        params.cpuparams.n_threads = params.cpuparams_batch.n_threads = threads
        params.n_threads_http = 1
        params.warmup = False
        params.embedding = True
        params.pooling_type = xllamacpp.llama_pooling_type.LLAMA_POOLING_TYPE_NONE
        params.embd_normalize = -1  # the states as the final norm gives them
        params.verbosity = 0
        params.hostnames = ["127.0.0.1"]
        params.port = 0  # the system's pick of a free port (module docstring)
        secret = secrets.token_hex(16)
        params.api_keys = [secret]
        params.api_prefix = f"/{secret}"
        try:
            self._server = xllamacpp.Server(params)
        except Exception as exc:
            raise InputError(f"llama.cpp cannot load the file: {exc}", self.checkpoint.gguf_file) from None
        address = self._server.listening_address.rstrip("/")
        if not address.startswith("http://127.0.0.1:"):
            self._stop()
            raise DependencyError(f"xllamacpp's server listens on {address}, not on this machine's loopback")
        self._base, self._key, self._context = address + params.api_prefix, secret, tokens
        props = self._ask("/props")
        if not isinstance(props, dict) or props.get("model_path") != str(self.checkpoint.gguf_file):
            self._stop()
            raise DependencyError(
                f"the server at {address} is not the one evalsuite started for {self.checkpoint.gguf_file}: "
                f"it serves {props.get('model_path') if isinstance(props, dict) else type(props).__name__}"
            )
        return self._server

    def _ask(self, route: str, body: dict[str, Any] | None = None) -> Any:
        """The JSON answer of the side's own server to a GET of `route` (a POST of `body`), asked on the
        loopback with no proxy."""
        request = urllib.request.Request(
            self._base + route,
            data=None if body is None else json.dumps(body).encode(),
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {self._key}"},
        )
        try:
            with LOOPBACK.open(request, timeout=3600) as response:
                return json.loads(response.read())
        except (urllib.error.URLError, OSError, ValueError) as exc:
            reason = getattr(exc, "reason", None) or exc
            raise DependencyError(
                f"llama.cpp's server at {self._base.rsplit('/', 1)[0]} did not answer {route}: {reason}"
            ) from None

    def final_states(self, window: torch.Tensor) -> torch.Tensor:
        """llama.cpp's final-norm output at every position of one window of token ids, float32
        (tokens, hidden)."""
        ids = [int(t) for t in window.reshape(-1)]
        self._started(len(ids))
        doc = self._ask("/embedding", {"content": ids})
        rows = doc[0].get("embedding") if isinstance(doc, list) and doc and isinstance(doc[0], dict) else None
        if not isinstance(rows, list) or len(rows) != len(ids):
            got = len(rows) if isinstance(rows, list) else type(doc).__name__
            raise InputError(
                f"llama.cpp returned {got} states for a window of {len(ids)} tokens (a BOS added, or the "
                "window cut)",
                self.checkpoint.gguf_file,
            )
        return torch.tensor(rows, dtype=torch.float32)

    def window_logits(self, windows: torch.Tensor, positions: torch.Tensor) -> Iterator[torch.Tensor]:
        """Each window one batch through llama.cpp; the head on the states at `positions`, float32."""
        for window in windows:
            states = self.final_states(window)[positions]
            yield states @ self.head.T

    def generate_greedy(self, *args: Any, **kwargs: Any) -> Any:
        raise InputError(f"backend {BACKEND} scores windows; it does not generate ({NO_GENERATION})")

    def image_features(self, inputs: dict[str, Any]) -> torch.Tensor:
        raise InputError(f"backend {BACKEND} runs the text model of a GGUF file; it reads no image")

    def _stop(self) -> None:
        self._server = None  # its destructor stops the server's loop and frees the model
        self._context, self._base, self._key = 0, "", ""

    def close(self) -> None:
        self._stop()
