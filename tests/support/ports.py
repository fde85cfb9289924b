"""Free loopback ports, for the servers tests start.

The one rule is the library's own (asyncrl.platform.redis_server.free_port, which picks the
embedded Redis' port): bind port 0 on 127.0.0.1, read the port the kernel chose, close. Tests
import it from here, the library keeps it for its own use."""

from asyncrl.platform.redis_server import free_port

__all__ = ["free_port"]
