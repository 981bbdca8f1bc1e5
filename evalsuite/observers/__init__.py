"""The observers tasks share: how a side's logits over windows, its states at layer boundaries, its forced
answers and its greedy answers are observed and stored (ARCHITECTURE.md, floor 6). A task plugin
(`evalsuite.tasks`) composes them; none of them knows a task."""
