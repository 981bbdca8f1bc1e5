"""The contract's data: validated specs, observations on disk, results.json's typed models. Imports `stats`
and `files`."""
