"""asyncrl: fully asynchronous reinforcement learning for language models."""

import os

# Before anything imports grpc: services are started with a preexec_fn
# (asyncrl.platform.children), so Popen really forks, and gRPC's fork handler can wait forever
# on a thread of the parent's own channels (grpc/grpc#37259). Set here, where every importer of
# asyncrl passes first, not where a child is started: by then another module may have imported
# grpc (a test session did, and hung). Nothing of asyncrl uses gRPC in a forked child.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

__version__ = "0.1.0"
