"""Rewards: math verification, the code sandbox, a job's Python function or HTTP endpoint."""
