"""Free loopback ports, for the servers tests start.

The one rule is the library's own (asyncrl.platform.redis_server.free_port, which picks the
local runner's ports): a port below the kernel's ephemeral range that binds, never the same
twice in one process. Tests import it from here, the library keeps it for its own use."""

from asyncrl.platform.redis_server import free_port

__all__ = ["free_port"]
