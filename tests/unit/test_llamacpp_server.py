"""The llama.cpp side talks only to the server it started (backends/llamacpp.py): a server of another, found
at the address the binding reports, is refused before any window's token ids are read back as states."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest
import torch

from evalsuite.backends.llamacpp import LlamaCppBackend
from evalsuite.backends.options import BackendOptions
from evalsuite.errors import DependencyError
from tests.unit.test_gguf_format import head_file


class _Another(BaseHTTPRequestHandler):
    """A server that answers every path, key or none: a model of its own, and states of its own (zeros)."""

    def _answer(self, doc: object) -> None:
        body = json.dumps(doc).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        self._answer({"model_path": "/elsewhere/another.gguf"})

    def do_POST(self) -> None:
        ids = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["content"]
        self._answer([{"index": 0, "embedding": [[0.0] * 4 for _ in ids]}])

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def another_server() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Another)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_a_server_that_is_not_the_sides_own_is_refused_before_its_states_are_read(
    tmp_path, monkeypatch, another_server
):
    xllamacpp = pytest.importorskip("xllamacpp", reason="backend llamacpp needs xllamacpp")
    started: list[object] = []

    class Misdirected:
        """xllamacpp's Server as the side would find it if another server held the address it reports."""

        def __init__(self, params: object) -> None:
            started.append(params)
            self.listening_address = another_server

    monkeypatch.setattr(xllamacpp, "Server", Misdirected)
    checkpoint = SimpleNamespace(format="gguf", **vars(head_file(tmp_path / "m.gguf")))
    backend = LlamaCppBackend(checkpoint, BackendOptions(backend="llamacpp"))  # type: ignore[arg-type]
    with pytest.raises(DependencyError) as caught:
        backend.final_states(torch.arange(3))
    assert started and "is not the one evalsuite started" in str(caught.value)
    assert str(tmp_path / "m.gguf") in str(caught.value) and "/elsewhere/another.gguf" in str(caught.value)
