"""evalsuite: does this quantized checkpoint still behave like its BF16 source?

The package face: what a Python caller uses, and all of it (docs/api.md; what may change between versions is
docs/stability.md). Everything else in the package is an implementation a caller never imports.

    import evalsuite
    outcome = evalsuite.run("my-w4a8", "my-bf16", tasks=["ppl", "tensors"], out=Path("reports/w4a8"))
    outcome.verdict, outcome.results.tasks["ppl"].metrics["ppl_ratio"]
"""

from evalsuite.api import (
    CompareOutcome,
    RecordOutcome,
    RunOutcome,
    cache,
    compare,
    record,
    report,
    run,
    tune_allocator,
)
from evalsuite.contract.results import (
    SCHEMA_VERSION,
    CheckRecord,
    Comparison,
    RecordingManifest,
    Results,
    TaskRecord,
    json_schema,
    load_comparison,
    load_recording_manifest,
    load_results,
)
from evalsuite.errors import Cancelled, DependencyError, EvalsuiteError, InputError, ResourceError
from evalsuite.version import __version__

__all__ = [
    "SCHEMA_VERSION",
    "Cancelled",
    "CheckRecord",
    "CompareOutcome",
    "Comparison",
    "DependencyError",
    "EvalsuiteError",
    "InputError",
    "RecordOutcome",
    "RecordingManifest",
    "ResourceError",
    "Results",
    "RunOutcome",
    "TaskRecord",
    "__version__",
    "cache",
    "compare",
    "json_schema",
    "load_comparison",
    "load_recording_manifest",
    "load_results",
    "record",
    "report",
    "run",
    "tune_allocator",
]
