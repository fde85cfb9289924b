"""Reward service: the gRPC front of asyncrl.scoring (math verification, the code sandbox, a
job's own Python function or HTTP endpoint), for rollout workers on other machines."""
