"""Reward service: math verification, the code sandbox, a job's own Python function or HTTP
endpoint."""
