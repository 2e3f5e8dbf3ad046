"""Start N local processes with a process group (gloo on CPU, NCCL on GPU) and run a function in each."""

from __future__ import annotations

import atexit
import os
import socket
import sys
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .errors import FxShardError
from .runtime.replay_watch import aborted_here


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _end_with_launcher(launcher: int, rank: int, every_s: float = 1.0) -> None:
    """A daemon thread that ends this rank once the launching process `launcher` is gone (killed, or
    interrupted while the ranks ran): a rank's parent is the forkserver, which outlives a killed
    launcher, so without it the ranks trained on as orphans."""
    import threading

    def watch():
        while True:
            time.sleep(every_s)
            try:
                os.kill(launcher, 0)
            except ProcessLookupError:
                print(f"fxshard: rank {rank}: the launching process {launcher} is gone; ending this rank",
                      file=sys.stderr, flush=True)
                os._exit(1)
            except PermissionError:  # the pid was reused by another user's process: it is gone too
                os._exit(1)

    threading.Thread(target=watch, name="fxshard-launcher-watch", daemon=True).start()


def _finished_barrier(rank: int, heads_up_s: float = 30.0) -> None:
    """The barrier every rank reaches once `fn` returned; after `heads_up_s` this rank says it waits:
    a rank still inside a step waits there for this one (the ranks ran a different number of steps,
    or of collective calls), and its timeout error sends the reader to this rank's log."""
    work = dist.barrier(async_op=True)
    started = time.monotonic()
    while not work.is_completed():
        if heads_up_s is not None and time.monotonic() - started > heads_up_s:
            print(f"fxshard: rank {rank} finished and has waited {heads_up_s:.0f} s for the other ranks to finish: a "
                  f"rank still inside a step waits for this one (did the ranks call step(), evaluate(), save() or "
                  f"parameters() a different number of times?)", file=sys.stderr, flush=True)
            heads_up_s = None
        time.sleep(0.01)
    work.wait()


def _worker(rank, nprocs, port, backend, out_dir, fn, args, environ, launcher):
    _end_with_launcher(launcher, rank)
    # a forkserver child has the server's environment, from when it started: give it the caller's now
    # (NCCL and fxshard read theirs after import)
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(nprocs), LOCAL_RANK=str(rank))
    if backend == "nccl":
        torch.cuda.set_device(rank)
    else:  # N processes share the host's cores: oversubscribed intra-op threads slow every rank down
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // nprocs))
    dist.init_process_group(backend, rank=rank, world_size=nprocs)
    failed = False
    try:
        result = fn(*args)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))  # saved before any teardown can hang
        if aborted_here():  # a replay watch aborted the groups: tearing them down can hang (replay_watch.py)
            sys.stdout.flush()  # status 0, not the watch's 1: the result is saved, and run_local collects it
            sys.stderr.flush()
            os._exit(0)
        if dist.is_initialized():  # `fn` may have left the group itself (a test of a rank that dies)
            _finished_barrier(rank)
    except BaseException as error:
        # said now: tearing the groups down below can wait forever on a peer still inside a collective,
        # and then the error would never reach run_local (2x H200, session 30: benchmark runs that went
        # silent for minutes)
        if isinstance(error, FxShardError):  # the user's to mend: the message says how, run_local raises it
            print(f"fxshard: rank {rank} failed: {error}", file=sys.stderr, flush=True)
            with open(os.path.join(out_dir, f"rank{rank}.error"), "w") as file:
                file.write(str(error))
        elif not isinstance(error, (KeyboardInterrupt, SystemExit)):
            print(f"fxshard: rank {rank} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        failed = True
        if backend == "nccl":
            # nor torch's own teardown of the live groups at exit: once torch.multiprocessing has written
            # the error for run_local, the process ends without it
            atexit.register(os._exit, 1)
        raise
    finally:
        if dist.is_initialized() and not aborted_here() and not (failed and backend == "nccl"):
            dist.destroy_process_group()


def _start_method(backend: str) -> str:
    """forkserver for gloo ranks on a machine without CUDA, where the platform has it: each run's
    processes fork from one server process that imported torch and fxshard once, where a spawned
    process imports them again (~2.5 s per run on a 2-core machine, and the test suite starts dozens
    of runs). spawn everywhere else: a process forked after anything asked CUDA even for its device
    count cannot use CUDA, and nothing proves that importing fxshard (Inductor, Triton) never does.
    FXSHARD_START_METHOD overrides the choice."""
    cpu_only = backend == "gloo" and not torch.cuda.is_available()
    methods = mp.get_all_start_methods()
    method = os.environ.get("FXSHARD_START_METHOD") or (
        "forkserver" if cpu_only and "forkserver" in methods else "spawn")
    if method not in methods:
        raise FxShardError(f"FXSHARD_START_METHOD={method!r} is not a start method this platform has "
                           f"({', '.join(methods)}); unset it, or set spawn")
    if method == "forkserver":
        mp.set_forkserver_preload(["torch", "torch.distributed", "fxshard"])  # read when the server starts
    return method


def run_local(fn, nprocs: int, *args, backend: str | None = None) -> list:
    """Run `fn(*args)` in `nprocs` fresh processes (rank = process index, process group initialized);
    return each rank's return value. `fn` must be importable (a module-level function). Each process
    sees the caller's environment as it is at this call."""
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise FxShardError(f"run_local needs a number of processes >= 1, got {nprocs!r}")
    qualname = getattr(fn, "__qualname__", "")
    if "<lambda>" in qualname or "<locals>" in qualname:  # said here, not as a pickling error in a new process
        raise FxShardError(f"run_local needs a function the ranks can import (defined at a module's top level); "
                           f"{qualname} is a lambda or a nested function: move it to module level")
    backend = backend or ("nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= nprocs else "gloo")
    with tempfile.TemporaryDirectory() as out_dir:
        worker_args = (nprocs, _free_port(), backend, out_dir, fn, args, dict(os.environ), os.getpid())
        context = mp.start_processes(_worker, args=worker_args, nprocs=nprocs, start_method=_start_method(backend),
                                     join=False)
        try:
            while not context.join():
                pass
        except BaseException:  # Ctrl-C here, or a rank failed: no rank trains on without its launcher
            for process in context.processes:
                if process.is_alive():
                    process.terminate()
            for process in context.processes:
                process.join(10)
            said = sorted(name for name in os.listdir(out_dir) if name.endswith(".error"))
            if said:  # a rank's FxShardError: the caller gets it as one, not as a page of tracebacks
                with open(os.path.join(out_dir, said[0])) as file:
                    message = file.read()
                raise FxShardError(f"{said[0][:-len('.error')].replace('rank', 'rank ')}: {message}") from None
            raise
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(nprocs)]
