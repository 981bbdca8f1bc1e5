"""What a quantized checkpoint stores, proved from its files against its source: the `tensors` task's engine.

A candidate tensor pairs with a source tensor in one of two ways: under the same name (a tensor kept as it
was: *protected*, and it must be byte-identical), or as one of the tensors a format stores for a quantized
module `X` in place of the source's `X.weight` (*quantized*). A source tensor with neither is *missing*; a
candidate tensor that pairs with nothing is *unexpected*. `verify_tensors` streams both checkpoints to put
every source tensor in exactly one class and to measure each pair, with memory bounded by a block of rows
(`evalsuite.formats.ShardReader`).

The formats (`evalsuite.formats`) say what a quantized module stores and how it decodes; what is checked of
them is here: `_compressed_tensors` decodes every weight with `evalsuite.formats.ct_decode` and measures it,
has compressed-tensors' decompressor decode a sample of its rows (or all of them) to agree bit for bit
(`library_runs`; the library's decode of every row where evalsuite has no decode of the format), and checks
the config's groups against the stored schemes, `_exl3` checks trellis layouts and `tensor_storage`, `_gguf`
decodes a GGUF file's tensors under the source's names and its metadata's claims. `_same`
compares a tensor kept under its name, `_outliers` judges each channel against its tensor's channels and
each tensor against its siblings, `_modules` tells modules apart by name and shape (and builds the model
skeleton targets are matched on), `_rows` holds the typed rows of tensors.json, `_engine` pairs and streams.
"""

from evalsuite.tasks.tensors._verification._compressed_tensors import LibraryCheck, library_runs
from evalsuite.tasks.tensors._verification._engine import Verification, verify_tensors
from evalsuite.tasks.tensors._verification._gguf import check_gguf_source
from evalsuite.tasks.tensors._verification._modules import ModuleRules, layer_and_projection
from evalsuite.tasks.tensors._verification._pairing import pair_tensors
from evalsuite.tasks.tensors._verification._rows import ErrorAccumulator, TensorRow

__all__ = [
    "ErrorAccumulator",
    "LibraryCheck",
    "ModuleRules",
    "TensorRow",
    "Verification",
    "check_gguf_source",
    "layer_and_projection",
    "library_runs",
    "pair_tensors",
    "verify_tensors",
]
