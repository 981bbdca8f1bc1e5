"""Statistics: pure functions on arrays (metrics, what a figure lets a report claim, token ranks, logit rows,
tensor errors). Imports nothing of evalsuite but `errors`."""
