"""The built-in task plugins, one module each. `evalsuite.registry` finds them (and third-party tasks)."""
