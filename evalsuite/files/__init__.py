"""Files on disk: checkpoints read as files (safetensors headers, mapped tensors, identities and leases,
digests, manifests), the run folder and the run cache. Imports `errors` and `version` only."""
