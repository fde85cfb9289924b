"""The whole job on one machine: `asyncrl run`, its live view, report and synchronous mode."""
