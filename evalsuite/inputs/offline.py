"""The Hub kept offline for a block of code, whether or not its libraries are already imported.

`huggingface_hub` and `datasets` read `HF_HUB_OFFLINE` once, at import, into module constants. The command
line sets the variable before anything imports them, but a caller in Python (a notebook, `compare()` from a
script, a test session) usually has them imported already, and there setting the variable changes nothing:
a dataset missing from the cache is then looked up on the Hub, with retries, for half a minute. So the
constants themselves are set for the block, and put back after it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

# (module, attribute) pairs that hold the offline switch once their module is imported.
_SWITCHES = (
    ("huggingface_hub.constants", "HF_HUB_OFFLINE"),
    ("datasets.config", "HF_HUB_OFFLINE"),
    ("datasets.config", "HF_DATASETS_OFFLINE"),
)
_VARIABLES = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")


@contextmanager
def hub_offline(enabled: bool = True) -> Iterator[None]:
    """Inside the block, nothing is fetched from the Hub (only local caches are read) when `enabled`; a
    no-op otherwise (`--allow-download`)."""
    if not enabled:
        yield
        return
    saved_env = {name: os.environ.get(name) for name in _VARIABLES}
    saved: list[tuple[object, str, object]] = []
    for name in _VARIABLES:
        os.environ[name] = "1"
    for module_name, attribute in _SWITCHES:
        module = sys.modules.get(module_name)
        if module is not None and hasattr(module, attribute):
            saved.append((module, attribute, getattr(module, attribute)))
            setattr(module, attribute, True)
    try:
        yield
    finally:
        for module, attribute, value in reversed(saved):
            setattr(module, attribute, value)
        for name, value in saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
