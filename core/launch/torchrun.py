"""The torchrun options that start a multi-process trainer, shared by the operator (in each
trainer pod) and `asyncrl run` (on this machine). What follows them is the ordinary
`serve trainer ...` command line; every process runs it, and asyncrl.trainer.service finds
its rank in torchrun's environment.

No torch import here: the operator uses this module too.
"""

from __future__ import annotations

# asyncrl run: a trainer rank that dies takes the group down and torchrun starts it again,
# resuming from the last checkpoint, at most this many times before the job fails.
LOCAL_MAX_RESTARTS = 3
#: Seconds a node of a multi-node trainer waits for the rendezvous store (torch: 60).
RENDEZVOUS_READ_TIMEOUT = 600


def torchrun_arguments(
    nproc_per_node: int,
    *,
    nnodes: int = 1,
    rendezvous_endpoint: str | None = None,
    rendezvous_id: str | None = None,
    max_restarts: int = 0,
) -> list[str]:
    """torchrun's options and `-m asyncrl.cli`: one node on its own (`--standalone`) without a
    rendezvous endpoint, else c10d rendezvous at `rendezvous_endpoint` (host:port)."""
    if nproc_per_node < 1 or nnodes < 1 or max_restarts < 0:
        raise ValueError(f"nproc_per_node and nnodes must be >= 1 and max_restarts >= 0, got "
                         f"{nproc_per_node}, {nnodes}, {max_restarts}")
    arguments = [f"--nnodes={nnodes}", f"--nproc-per-node={nproc_per_node}"]
    if rendezvous_endpoint is None:
        if nnodes != 1:
            raise ValueError("more than one node needs a rendezvous endpoint")
        arguments.append("--standalone")
    else:
        # read_timeout: how long a node waits for the store on the rendezvous host; torch's
        # 60 s is shorter than a restarting pod 0 may take (its container restarts without
        # the init container that otherwise holds the others back).
        arguments += ["--rdzv-backend=c10d", f"--rdzv-endpoint={rendezvous_endpoint}",
                      f"--rdzv-id={rendezvous_id or 'asyncrl'}",
                      f"--rdzv-conf=read_timeout={RENDEZVOUS_READ_TIMEOUT}"]
    if max_restarts:
        arguments.append(f"--max-restarts={max_restarts}")
    return [*arguments, "-m", "asyncrl.cli"]
