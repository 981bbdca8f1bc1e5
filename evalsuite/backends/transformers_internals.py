"""The private Transformers (and compressed-tensors) internals evalsuite's execution calls, probed before any
model loads.

Streamed execution materialises one decoder layer at a time with Transformers' own loading functions
(`evalsuite.backends.streamed`), which are not public API: a Transformers release may rename or drop them.
Rather than fail with an AttributeError an hour into a run (or, worse, exit as if a check had failed), every
internal a load plan will call is looked up when the run is planned; one that is missing is a one-line
`DependencyError` (exit 2) naming it and the installed version.
"""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version

from evalsuite.backends.options import BackendOptions
from evalsuite.errors import DependencyError

# The Transformers series these internals were read from (pyproject pins it); each entry below is
# (module, attribute path inside it).
TESTED_TRANSFORMERS = "5.24"
# `_model_class` picks the Auto class from these tables (every backend that builds a Transformers model).
MODEL_CLASS_INTERNALS = (
    ("transformers.models.auto.modeling_auto", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"),
    ("transformers.models.auto.modeling_auto", "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES"),
)
# `TransformersLayers` (backend `hf`, streamed).
STREAMED_INTERNALS = (
    ("transformers.conversion_mapping", "get_model_conversion_mapping"),
    ("transformers.modeling_utils", "LoadStateDictConfig"),
    ("transformers.modeling_utils", "PreTrainedModel._get_dtype_plan"),
    ("transformers.modeling_utils", "PreTrainedModel.initialize_weights"),
    ("transformers.core_model_loading", "WeightConverter"),
    ("transformers.core_model_loading", "WeightRenaming"),
    ("transformers.core_model_loading", "rename_source_key"),
    ("transformers.core_model_loading", "convert_and_load_state_dict_in_model"),
    # A layer's tensors that are only renamed, and a step's routed experts, set without the loop above.
    ("transformers.core_model_loading", "set_param_for_module"),
    ("transformers.core_model_loading", "build_glob_alternation"),
    ("transformers.core_model_loading", "MergeModulelist"),
    ("transformers.core_model_loading", "Concatenate"),
    ("transformers.utils.loading_report", "LoadStateDictInfo"),
    # Left out for a streamed decoding on the CPU, as a loaded model's own device leaves it out.
    ("transformers.generation.utils", "GenerationMixin._optimize_model_for_decode"),
)
# A compressed-tensors checkpoint streamed: each layer decompressed by the function its loader's hook applies.
STREAMED_COMPRESSED_INTERNALS = (
    ("compressed_tensors.compressors", "ModelCompressor.remove_decompression_hook"),
    ("compressed_tensors.compressors", "decompress_module"),
    ("compressed_tensors.quantization.utils", "is_module_quantized"),
    # The same decompression, of several modules' rows in one call (`evalsuite.formats.ct_batch`).
    ("compressed_tensors.compressors", "BaseCompressor.decompress"),
    ("compressed_tensors.compressors.format", "infer_module_format"),
    ("compressed_tensors.utils", "get_direct_state_dict"),
    ("compressed_tensors.utils", "replace_direct_state_dict"),
    ("transformers.integrations.compressed_tensors", "CompressedTensorsDequantize"),
    ("transformers.integrations.compressed_tensors", "get_experts_scheme"),
)


def missing_internals(internals: tuple[tuple[str, str], ...]) -> list[str]:
    """The dotted names of `internals` that cannot be found (imported and looked up, nothing called)."""
    missing = []
    for module_name, path in internals:
        try:
            target: object = importlib.import_module(module_name)
            for part in path.split("."):
                target = getattr(target, part)
        except (ImportError, AttributeError):
            missing.append(f"{module_name}.{path}")
    return missing


def needed_internals(options: BackendOptions, checkpoint_format: str) -> tuple[tuple[str, str], ...]:
    """What a load with these options will call."""
    needed = MODEL_CLASS_INTERNALS
    if options.stream and options.backend == "hf":
        needed += STREAMED_INTERNALS
        if checkpoint_format == "compressed-tensors":
            needed += STREAMED_COMPRESSED_INTERNALS
    return needed


def check_internals(options: BackendOptions, checkpoint_format: str) -> None:
    """Refuse, before any model loads, a load whose library internals are not there (DependencyError)."""
    missing = missing_internals(needed_internals(options, checkpoint_format))
    if not missing:
        return
    installed = []
    for package in ("transformers", "compressed-tensors"):
        try:
            installed.append(f"{package} {version(package)}")
        except PackageNotFoundError:
            installed.append(f"{package} not installed")
    how = "streamed execution" if options.stream else f"backend {options.backend}"
    raise DependencyError(
        f"{how} needs {', '.join(missing)}, which {' / '.join(installed)} lacks (evalsuite calls these "
        f"private internals as Transformers {TESTED_TRANSFORMERS} has them; install that series)"
    )
