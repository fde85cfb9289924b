"""Reward service: math verification and the code sandbox."""
