"""Statistics: pure functions on arrays (metrics, what a figure lets a report claim, token ranks, logit rows,
tensor errors, what a long answer is). Imports nothing of evalsuite but `errors`."""
