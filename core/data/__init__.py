"""Prompts and samples: generated and file datasets, their order, and the sample path's types."""
