"""Plots from arrays to PNG files, drawn in a process of their own. Imports `files` (atomic writes) and
nothing above."""
