"""The built-in task plugins, one module each (a package where a task has pieces of its own: `tensors`,
`moe`, `lmeval`, `vision`); the machinery they share is `evalsuite.observers`. `evalsuite.pipeline.registry`
finds them (and third-party tasks)."""
