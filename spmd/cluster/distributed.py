"""Multi-process runs: joining the process group a mesh file names (``init_distributed``),
and starting N local processes that form one jax.distributed job (``launch_local``: several
hosts tested on one box)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading

from spmd.cluster.mesh import DeviceMesh

__all__ = ["free_port", "init_distributed", "launch_local"]


def init_distributed(mesh: DeviceMesh) -> None:
    """Join the process group the mesh names (gloo collectives on CPU); no-op for one process."""
    import jax

    dist = mesh.distributed
    if dist is None:
        return
    if mesh.platform == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(dist.coordinator, num_processes=dist.num_processes,
                               process_id=dist.process_id)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _pump(stream, prefix: str) -> None:
    for line in iter(stream.readline, ""):
        sys.stdout.write(f"{prefix}{line}")
        sys.stdout.flush()


def launch_local(command: list[str], num_processes: int, port: int = 0) -> int:
    """Run ``command`` in ``num_processes`` processes with SPMD_COORDINATOR, SPMD_NUM_PROCESSES
    and SPMD_PROCESS_ID set (mesh files read them); return the worst exit status."""
    port = port or free_port()
    procs, pumps = [], []
    for pid in range(num_processes):
        env = dict(os.environ, SPMD_COORDINATOR=f"127.0.0.1:{port}",
                   SPMD_NUM_PROCESSES=str(num_processes), SPMD_PROCESS_ID=str(pid))
        proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        pump = threading.Thread(target=_pump, args=(proc.stdout, f"[p{pid}] "), daemon=True)
        pump.start()
        procs.append(proc)
        pumps.append(pump)
    codes = [proc.wait() for proc in procs]
    for pump in pumps:
        pump.join()
    return max(codes, key=abs)
