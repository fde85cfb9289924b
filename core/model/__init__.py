"""The policy model: loading it and computing per-token log-probabilities."""
