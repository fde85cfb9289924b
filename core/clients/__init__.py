"""Clients of the buffer and reward services, used by the other services."""
