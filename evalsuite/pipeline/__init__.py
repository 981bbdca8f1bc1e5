"""The run: the registry of tasks, the plan from files, observing one model at a time, the runner and the
device table. Imports every wing below it, never `reporting`, `candidates` or `cli`."""
