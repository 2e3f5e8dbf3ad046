"""Reproduces the gloo heap corruption that fxshard/runtime/gloo.py works around, with nothing but torch.

Each run starts `--world` gloo processes; each does `--rounds` rounds of 1-8 all-gathers of small
float tensors issued back to back (the same sizes on every rank), then waits for them in a random
local order, as a ZeRO-3 step with prefetch does. `--path functional` issues them with
`torch.ops._c10d_functional.all_gather_into_tensor` (gloo: `allgather_into_tensor_coalesced`),
`--path base` with `dist.all_gather_into_tensor(async_op=True)` (gloo: `_allgather_base`) and
`_register_work`, as fxshard's lowering does. A run that corrupts the heap dies with
"malloc(): unaligned tcache chunk detected" (SIGABRT) or SIGSEGV.

    python tools/repro_gloo_all_gather.py --path functional --runs 12   # torch 2.13.0+cpu: 2 to 8 of 12 die
    python tools/repro_gloo_all_gather.py --path base --runs 12         # none (0 of 36 measured)
"""

from __future__ import annotations

import argparse
import os
import random
import socket
import subprocess
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _rank(rank: int, world: int, port: int, rounds: int, path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    group_name = dist.group.WORLD.group_name
    sizes = random.Random(0)  # the same sizes on every rank
    for _ in range(rounds):
        in_flight = []
        for _ in range(sizes.randint(1, 8)):
            shard = torch.randn(sizes.choice([1, 4, 8, 16, 32, 64, 200]))
            if path == "functional":
                gathered = torch.ops._c10d_functional.all_gather_into_tensor(shard, world, group_name)
            else:
                gathered = torch.empty(shard.numel() * world)
                work = dist.all_gather_into_tensor(gathered, shard, async_op=True)
                torch._C._distributed_c10d._register_work(gathered, work)
            in_flight.append(gathered)
            scratch = [torch.randn(sizes.choice([1, 8, 64])) for _ in range(sizes.randint(0, 6))]
            del scratch
        random.shuffle(in_flight)  # each rank waits in its own order
        for gathered in in_flight:
            torch.ops._c10d_functional.wait_tensor(gathered).add_(1)
    dist.barrier()
    dist.destroy_process_group()


def _one_run(world: int, rounds: int, path: str) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.start_processes(_rank, args=(world, port, rounds, path), nprocs=world, start_method="spawn")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--path", choices=["functional", "base"], default="functional")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1500)
    parser.add_argument("--runs", type=int, default=12)
    parser.add_argument("--one-run", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one_run:
        _one_run(args.world, args.rounds, args.path)
        return
    died = 0
    for run in range(args.runs):  # each run in its own interpreter: a corrupted heap ends only that one
        result = subprocess.run([sys.executable, __file__, "--one-run", "--path", args.path, "--world",
                                 str(args.world), "--rounds", str(args.rounds)], capture_output=True, text=True)
        if result.returncode != 0:
            died += 1
            last = [line for line in result.stderr.splitlines() if "malloc" in line or "signal" in line]
            print(f"run {run + 1}: died: {last[-1] if last else result.stderr.strip()[-200:]}", flush=True)
        else:
            print(f"run {run + 1}: ok", flush=True)
    print(f"torch {torch.__version__}, path {args.path}, world {args.world}, {args.rounds} rounds: "
          f"{died} of {args.runs} runs died")


if __name__ == "__main__":
    main()
