"""Rollout service: interruptible generation and the rollout workflow."""
