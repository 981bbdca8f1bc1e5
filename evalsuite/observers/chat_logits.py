"""Chats' logits at their assistant tokens, reduced as the head makes them: `ppl` on chats.

A chat (`evalsuite.inputs.chat_files.ChatTokens`) is a sequence of its own length with scored positions of its
own (those predicting an assistant token). Each is forwarded alone, never padded (padding changes the
arithmetic), with the head applied to its scored positions only and a chunk of them at a time (`ChunkedHead`;
a backend without it returns the logits of the scored positions, one chat's worth), or, on a streamed side, in
the shared pass over its layers (`pass_sequences`, `visitor`). Each chunk is reduced at once, as on long
windows (`evalsuite.observers.compact_window_logits`):
- the reference keeps its compact form (`compact_reduction`: top-k, the tail's mass, seeded samples of the
  tail), its NLL, top token and ranked tokens: its observation is its own recording;
- the candidate, observed after it, keeps its log-probs at the ids the reference kept
  (`at_reference_reduction`), its NLL, top token and ranked tokens.
KL(ref ‖ ckpt) is then exact over the reference's top-k and a sampled estimate beyond
(`kld_detail.kld_at_reference`), labelled as such. Per scored token both observations also keep its chat,
its assistant turn and the token itself (`chat`, `turn`, `target`).

Each chat's arrays are saved as it completes: an interrupted observation resumes at the next chat.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from evalsuite.backends.c_heap import map_large_allocations
from evalsuite.backends.layer_pass import PassSequence, QuietVisitor, observe_alone
from evalsuite.contract.observation import Observation
from evalsuite.errors import InputError
from evalsuite.observers.compact_window_logits import (
    REFERENCE_LABEL,
    at_reference_reduction,
    compact_reduction,
    joined_window_parts,
    logit_blocks,
    save_window_part,
    window_part,
    with_targets,
)
from evalsuite.observers.window_logits import RecordOptions, check_logits_shape
from evalsuite.protocol.task import Inputs, Progress

if TYPE_CHECKING:
    from evalsuite.backends import Backend
    from evalsuite.backends.layer_pass import LayerVisitor
    from evalsuite.backends.streamed import StreamedBackend, WindowCall
    from evalsuite.inputs.chat_files import ChatTokens

# The inputs' key of the chats, tokenised (`ChatTokens`, in order), and of their tags.
CHATS = "chats"
CHAT_TAGS = "chat_tags"
REFERENCE_NAME = "chat-logits-compact"
CANDIDATE_NAME = "chat-logits-at-reference"

Blocks = Iterable[torch.Tensor]


def chat_inputs(chats: list[ChatTokens], tags: list[str], corpus: str, spans: str) -> Inputs:
    """The inputs both sides share: the chats' tokens (hashed with their scored positions: `tokens_sha256`),
    their tags, what they were read from and how their assistant tokens were found."""
    digest = hashlib.sha256()
    for chat in chats:
        for array in (chat.ids, chat.scored):
            digest.update(np.ascontiguousarray(array, dtype="<i8").tobytes() + b"\0")
    return {
        "corpus": corpus,
        "n_chats": len(chats),
        "n_scored_tokens": int(sum(len(c.scored) for c in chats)),
        "tokens_sha256": digest.hexdigest(),
        "assistant_spans": spans,
        CHATS: chats,
        CHAT_TAGS: tags,
    }


def is_chat_observation(obs: Observation) -> bool:
    """Whether an observation is of chats (`ChatLogits` or `ChatLogitsAtReference`)."""
    return obs.name in (REFERENCE_NAME, CANDIDATE_NAME)


class _ChatObserver:
    """Base of the two observers: each chat forwarded alone, its scored rows reduced `chunk_rows` at a time
    as the head makes them `head_rows` at a time, each chat's arrays saved as it completes."""

    name: str
    what: str

    def __init__(self, chunk_rows: int, head_rows: int) -> None:
        self.chunk_rows = chunk_rows
        self.head_rows = head_rows

    def identity(self) -> dict[str, Any]:
        return {"head_chunk_rows": self.head_rows}

    def reduce(
        self, index: int, blocks: Iterable[tuple[torch.Tensor, torch.Tensor]], inputs: Inputs, start: int
    ) -> dict:
        """One chat's arrays from its blocks of (logit rows, assistant tokens); its first row is row `start`
        of the observation."""
        raise NotImplementedError

    def check(self, backend: Any, inputs: Inputs) -> None:
        """Refuse, before any chat runs, what this side cannot be observed against."""

    def meta(self, meta: dict[str, Any]) -> dict[str, Any]:
        """The observation's metadata, given what every chat observation says of itself."""
        return meta

    def pass_sequences(self, inputs: Inputs) -> list[PassSequence]:
        """The chats as the sequences of a streamed side's shared layer pass."""
        return [
            PassSequence(f"chat:{inputs['tokens_sha256']}:{i}", torch.from_numpy(chat.ids))
            for i, chat in enumerate(inputs[CHATS])
        ]

    def observe(self, backend: Backend, inputs: Inputs, folder: Path, progress: Progress) -> Observation:
        from evalsuite.backends import ChunkedHead
        from evalsuite.backends.streamed import StreamedBackend

        if isinstance(backend, StreamedBackend):
            sequences = self.pass_sequences(inputs)
            return observe_alone(self.visitor(backend, inputs, folder), backend, sequences, folder, progress)
        chats: list[ChatTokens] = inputs[CHATS]
        vocab = backend.vocab_size

        def blocks_of(i: int) -> Blocks:
            ids, positions = torch.from_numpy(chats[i].ids)[None], torch.from_numpy(chats[i].scored)
            if isinstance(backend, ChunkedHead):
                states = next(iter(backend.window_scored_states(ids, positions)))
                return logit_blocks(states, self.head_rows, self.chunk_rows, vocab)
            # Without a head to apply per chunk: the scored positions' logits, one chat's worth at most.
            logits = next(iter(backend.window_logits(ids, positions)))
            check_logits_shape(logits, (len(positions), vocab))
            return logits.split(self.chunk_rows)

        return self.observed(backend, inputs, folder, blocks_of, progress(self.what, len(chats)))

    def visitor(self, backend: StreamedBackend, inputs: Inputs, folder: Path) -> LayerVisitor:
        """This observation made during a shared streamed pass: the head on each chat's last layer output."""
        return _ChatVisitor(self, backend, inputs, folder)

    def observed(
        self,
        backend: Any,
        inputs: Inputs,
        folder: Path,
        blocks_of: Callable[[int], Blocks],
        step: Callable[[], None],
    ) -> Observation:
        """The observation from each chat's blocks of logit rows (`blocks_of(i)`), reducing the chats not
        yet saved (an interrupted observation resumes at the first chat without its file)."""
        self.check(backend, inputs)
        map_large_allocations()
        chats: list[ChatTokens] = inputs[CHATS]
        start = 0
        for i, chat in enumerate(chats):
            if not window_part(folder, i).is_file():
                targets = torch.from_numpy(chat.targets)
                arrays = self.reduce(i, with_targets(blocks_of(i), targets), inputs, start)
                arrays.update(
                    chat=np.full(len(chat.scored), i, dtype=np.int32),
                    turn=chat.turn.astype(np.int32),
                    target=chat.targets.astype(np.int64),
                )
                save_window_part(folder, i, arrays)
            start += len(chat.scored)
            step()
        arrays = joined_window_parts(folder, len(chats))
        meta = {
            "vocab_size": backend.vocab_size,
            "n_chats": len(chats),
            "chat_tags": list(inputs[CHAT_TAGS]),
            "tokens_sha256": inputs["tokens_sha256"],
            "corpus": inputs["corpus"],
            "assistant_spans": inputs["assistant_spans"],
            "execution": backend.describe(),
            "head_chunk_rows": self.head_rows,
            "bytes_per_token": sum(a.nbytes for a in arrays.values()) // max(1, len(arrays["nll"])),
        }
        return Observation(name=self.name, meta=self.meta(meta), arrays=arrays)


class _ChatVisitor(QuietVisitor):
    """A chat observation during a shared streamed pass: each chat's final states at its scored positions,
    the head applied a chunk at a time."""

    def __init__(
        self, observer: _ChatObserver, backend: StreamedBackend, inputs: Inputs, folder: Path
    ) -> None:
        self.observer, self.backend, self.inputs, self.folder = observer, backend, inputs, folder

    def finish(self, final: list[torch.Tensor], calls: list[WindowCall]) -> Observation:
        chats: list[ChatTokens] = self.inputs[CHATS]
        observer, vocab = self.observer, self.backend.vocab_size

        def blocks_of(i: int) -> Blocks:
            states = self.backend.head_states(final[i], calls[i], torch.from_numpy(chats[i].scored))
            return logit_blocks(states, observer.head_rows, observer.chunk_rows, vocab)

        return observer.observed(self.backend, self.inputs, self.folder, blocks_of, lambda: None)


class ChatLogits(_ChatObserver):
    """Observer of the reference on chats: per assistant token its NLL, top token, ranked tokens and compact
    form (`compact_reduction`, with `record`'s options, the tail's samples seeded per chat), never its
    logits."""

    name = REFERENCE_NAME
    what = "chat logits, compact"

    def __init__(self, record: RecordOptions, chunk_rows: int, head_rows: int) -> None:
        super().__init__(chunk_rows, head_rows)
        self.record_options = record

    def identity(self) -> dict[str, Any]:
        return {**super().identity(), "record": self.record_options.model_dump(mode="json")}

    def reduce(
        self, index: int, blocks: Iterable[tuple[torch.Tensor, torch.Tensor]], inputs: Inputs, start: int
    ) -> dict:
        return compact_reduction(blocks, self.record_options, f"chat:{index}")

    def meta(self, meta: dict[str, Any]) -> dict[str, Any]:
        # The compact form a recording holds: the candidate and `compare` take it as they take a recording.
        opts = self.record_options
        return {**meta, "kind": "recorded", "top_k": opts.top_k, "tail_samples": opts.tail_samples}

    def record(self, obs: Observation, folder: Path) -> Observation:
        """The observation itself: it holds the compact form already."""
        return Observation(name=obs.name, key=obs.key, meta=dict(obs.meta), arrays=dict(obs.arrays))


class ChatLogitsAtReference(_ChatObserver):
    """Observer of the candidate on chats, given the reference's `ChatLogits` (or its recording): per
    assistant token its log-probs at the ids the reference kept, its NLL, top token and ranked tokens, and
    whether some token is most probable on both sides (`at_reference_reduction`)."""

    name = CANDIDATE_NAME
    what = "chat logits at the reference's ids"

    def check(self, backend: Any, inputs: Inputs) -> None:
        ref = _reference(inputs)
        if ref.meta.get("vocab_size") != backend.vocab_size:
            raise InputError(
                f"the reference's vocabulary ({ref.meta.get('vocab_size')} tokens) is not the candidate's "
                f"({backend.vocab_size})"
            )
        if ref.meta.get("tokens_sha256") != inputs["tokens_sha256"]:
            raise InputError(
                "the reference was observed on other chats, or other tokens, than the candidate's"
            )

    def reduce(
        self, index: int, blocks: Iterable[tuple[torch.Tensor, torch.Tensor]], inputs: Inputs, start: int
    ) -> dict:
        return at_reference_reduction(blocks, _reference(inputs).arrays, start)


def _reference(inputs: Inputs) -> Observation:
    observed = inputs.get("observed") or {}
    if REFERENCE_LABEL not in observed:
        raise InputError("the candidate's chat observation needs the reference's, observed first")
    return observed[REFERENCE_LABEL]
