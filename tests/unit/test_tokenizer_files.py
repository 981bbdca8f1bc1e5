"""Every file a tokenizer load may read is in the tokenizer's hash (`Checkpoint.tokenizer_files`), which keys
the token cache and decides whether two sides tokenize alike: the names are read from the installed
Transformers' own source, so that a Transformers that reads another file fails here instead of leaving
cached ids stale."""

from __future__ import annotations

import ast
from pathlib import Path

import transformers

from evalsuite.files.checkpoint import Checkpoint
from evalsuite.fixtures import TINY_BF16
from tests.conftest import copy_checkpoint

# What `PreTrainedTokenizerBase.from_pretrained` also finds by pattern rather than by a named constant: a
# versioned fast tokenizer (`fast_tokenizer_files`), Mistral's versioned SentencePiece model, and any
# SentencePiece model in the folder (`find_sentencepiece_model_file`).
FOUND_BY_PATTERN = ("tokenizer.4.0.json", "tokenizer.model.v3", "any-name.model")


def transformers_tokenizer_files() -> set[str]:
    """The file names Transformers' tokenization code names: every class's `VOCAB_FILES_NAMES`, the files
    every class reads beside them, the fallbacks (tiktoken, tekken) and a template in the chat templates'
    folder."""
    root = Path(transformers.__file__).parent
    sources = [
        *(root / name for name in ("tokenization_utils_base.py", "tokenization_utils_tokenizers.py")),
        *(root / name for name in ("tokenization_utils_sentencepiece.py", "tokenization_python.py")),
        root / "utils" / "hub.py",
        root / "integrations" / "mistral" / "constants.py",
        *sorted(root.glob("models/*/tokenization_*.py")),
    ]
    names: set[str] = set()
    for source in sources:
        for node in ast.walk(ast.parse(source.read_text(encoding="utf-8"))):
            if not (isinstance(node, ast.Assign) and len(node.targets) == 1):
                continue
            target, value = node.targets[0], node.value
            if not isinstance(target, ast.Name):
                continue
            if target.id == "VOCAB_FILES_NAMES" and isinstance(value, ast.Dict):
                names |= {
                    v.value for v in value.values if isinstance(v, ast.Constant) and isinstance(v.value, str)
                }
            elif isinstance(value, ast.Constant) and isinstance(value.value, str):
                if target.id.endswith(("_FILE", "_NAME")) and "." in value.value:
                    names.add(value.value)
                elif target.id == "CHAT_TEMPLATE_DIR":
                    names.add(f"{value.value}/tool_use.jinja")
    return names


def test_every_file_transformers_reads_for_a_tokenizer_is_in_its_hash(tiny_pair, tmp_path):
    names = transformers_tokenizer_files()
    # The source was read: the files every class reads, and the legacy one a review found missing.
    assert {"tokenizer.json", "tokenizer_config.json", "added_tokens.json", "spiece.model"} <= names
    folder = copy_checkpoint(tiny_pair[TINY_BF16], tmp_path / "model")
    listed = set(Checkpoint.open(folder).tokenizer_files())
    for name in sorted(names | set(FOUND_BY_PATTERN)):
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists():
            path.write_text("{}")
    found = {path.relative_to(folder).as_posix() for path in Checkpoint.open(folder).tokenizer_files()}
    missing = sorted((names | set(FOUND_BY_PATTERN)) - found)
    assert missing == []
    # Weights, configs and documentation are not the tokenizer's.
    assert {p.name for p in listed} == {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"}
