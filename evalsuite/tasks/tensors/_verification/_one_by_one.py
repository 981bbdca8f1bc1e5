"""What the verifiers of formats measured module by module share (EXL3, GPTQ / AWQ, block-wise FP8): nothing
of `measure_many` asked again by `check_config`, nothing to import before the workers fork."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from evalsuite.files.checkpoint import TensorInfo
from evalsuite.formats import ShardReader
from evalsuite.tasks.tensors._verification._rows import Problem, TensorRow


class OneByOneVerifier:
    """A `FormatVerifier` whose `measure_many` is its `measure` of each module in turn."""

    threads_only = False

    def __init__(self, format: Any) -> None:
        self.format = format
        self.module_matches: dict[Any, Any] = {}  # nothing of `measure_many` is asked again in check_config

    def before_fork(self) -> None:
        """Nothing by default: what the decode imports on first use the run has imported already."""

    def measure_many(
        self, modules: Sequence[tuple[TensorInfo, dict[str, TensorInfo], TensorRow]], reader: ShardReader
    ) -> list[list[Problem]]:
        """`measure` of each module."""
        return [self.measure(source, tensors, reader, row) for source, tensors, row in modules]

    def measure(
        self, source: TensorInfo, tensors: dict[str, TensorInfo], reader: ShardReader, row: TensorRow
    ) -> list[Problem]:
        """Fill one module's row and return what its stored tensors get wrong."""
        raise NotImplementedError
