"""Start N local processes with a process group (gloo on CPU, NCCL on GPU) and run a function in each."""

from __future__ import annotations

import os
import socket
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank, nprocs, port, backend, out_dir, fn, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(nprocs), LOCAL_RANK=str(rank))
    if backend == "nccl":
        torch.cuda.set_device(rank)
    else:  # N processes share the host's cores: oversubscribed intra-op threads slow every rank down
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // nprocs))
    dist.init_process_group(backend, rank=rank, world_size=nprocs)
    try:
        result = fn(*args)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))  # saved before any teardown can hang
        if dist.is_initialized():  # `fn` may have left the group itself (a test of a rank that dies)
            dist.barrier()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_local(fn, nprocs: int, *args, backend: str | None = None) -> list:
    """Run `fn(*args)` in `nprocs` fresh processes (rank = process index, process group initialized);
    return each rank's return value. `fn` must be importable (a module-level function)."""
    backend = backend or ("nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= nprocs else "gloo")
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_worker, args=(nprocs, _free_port(), backend, out_dir, fn, args), nprocs=nprocs,
                           start_method="spawn")
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(nprocs)]
