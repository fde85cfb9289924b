"""Buffer service: the Redis-backed staleness gate and sample store."""
