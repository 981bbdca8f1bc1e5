"""The registry of task plugins: the built-in ones and those of installed `evalsuite.tasks` entry points,
each with the spec file it ships.

A plugin module names its class with `@task("name")` (`evalsuite.protocol.task`); this module, one floor above
the plugins, imports them. A built-in task's spec is `tasks/NAME.toml` (the wheel's copy of it when
installed); a third-party task ships its own beside its code and says where with a `spec_file` class
attribute, a path relative to its module's package.
"""

from __future__ import annotations

import importlib
from importlib import resources
from importlib.metadata import entry_points
from pathlib import Path

from evalsuite.contract.spec import default_spec_path
from evalsuite.errors import InputError

ENTRY_POINT_GROUP = "evalsuite.tasks"


# One line per built-in task (adding a task is adding a line): its name, module and class. A run imports
# only the modules of the tasks it runs (`get_task`): each pulls in what its task needs, and a `ppl` run has
# no use for the imports of `vision` or `lmeval`.
_BUILTIN_TASKS = {
    "ppl": ("evalsuite.tasks.ppl", "Perplexity"),
    "smoke": ("evalsuite.tasks.smoke", "Smoke"),
    "longform": ("evalsuite.tasks.longform", "Longform"),
    "vision": ("evalsuite.tasks.vision", "Vision"),
    "tensors": ("evalsuite.tasks.tensors", "Tensors"),
    "intref": ("evalsuite.tasks.intref", "IntegerReference"),
    "layers": ("evalsuite.tasks.layers", "Layers"),
    "attribution": ("evalsuite.tasks.attribution", "Attribution"),
    "lmeval": ("evalsuite.tasks.lmeval", "LmEval"),
    "moe": ("evalsuite.tasks.moe", "MixtureOfExperts"),
    "tools": ("evalsuite.tasks.tools", "Tools"),
    "specdec": ("evalsuite.tasks.specdec", "SpeculativeDecoding"),
}


def _builtin_task(name: str) -> type:
    module, attribute = _BUILTIN_TASKS[name]
    cls = getattr(importlib.import_module(module), attribute)
    if getattr(cls, "name", None) != name:  # the table and the plugin's own `@task` name must agree
        raise RuntimeError(f"{module}.{attribute} is registered as {name!r} but names itself {cls.name!r}")
    return cls


def _builtin_tasks() -> list[type]:
    return [_builtin_task(name) for name in _BUILTIN_TASKS]


def registered_tasks() -> dict[str, type]:
    """Every task by name: the built-in ones, then those of installed entry points (which cannot replace a
    built-in name)."""
    tasks: dict[str, type] = {}
    for cls in _builtin_tasks():
        tasks[cls.name] = cls
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in tasks:
            continue
        try:
            cls = ep.load()
        except Exception as exc:
            raise InputError(
                f"entry point {ep.value!r} of task {ep.name!r} cannot be loaded: {exc}"
            ) from None
        if getattr(cls, "name", None) != ep.name:
            raise InputError(f"entry point {ep.name!r} names {ep.value!r}, which is not a task of that name")
        tasks[ep.name] = cls
    return dict(sorted(tasks.items()))


def get_task(name: str) -> type:
    """The task class registered as `name`; InputError listing the known names otherwise."""
    if name in _BUILTIN_TASKS:
        return _builtin_task(name)
    tasks = registered_tasks()
    if name not in tasks:
        raise InputError(f"unknown task {name!r}; known tasks: {', '.join(tasks)}")
    return tasks[name]


def spec_source(cls: type) -> Path:
    """The spec file a task runs with unless `--spec` replaces it: the one its package ships beside its code
    (`spec_file`), or evalsuite's own `tasks/NAME.toml`."""
    spec_file = getattr(cls, "spec_file", None)
    if spec_file:
        package = cls.__module__.rpartition(".")[0] or cls.__module__
        return Path(str(resources.files(package).joinpath(spec_file)))
    return default_spec_path(cls.name)
