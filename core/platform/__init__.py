"""Plumbing every process shares: settings, ports, devices, gRPC, Redis keys, outages."""
