"""What a run writes for people and CI from results.json alone: report.md, the model card and its tables,
JUnit XML. Imports `stats` and `files` only."""
