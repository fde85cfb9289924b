"""Trainer service: decoupled PPO updates and weight publication."""
