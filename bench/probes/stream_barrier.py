"""Can the copy-engine collectives' barriers hold no SM? Two GPUs of one host.

    python bench/probes/stream_barrier.py [--out FILE.json]

fxshard's copy-engine collectives (fxshard/runtime/copy_engine.py) move data with peer-to-peer memcpys,
but their two barriers per collective are torch's symmetric-memory barrier: a one-block kernel that
spins on a peer's signal, holding an SM while it waits (session 27, MoE ep=2: the GEMMs beside those
barriers ran ~4.1 ms a step longer than alone, more than the all-to-alls left exposed). CUDA's stream
memory operations wait without a kernel: `cuStreamWriteValue32` writes a word (here into a peer's
signal pad, mapped into this process by symmetric memory) after a memory fence, `cuStreamWaitValue32`
holds the stream until a word has a value. This probe checks, with a barrier built from them:

1. correctness, eager: 300 exchanges (write my step number into the peer's buffer, barrier, read the
   peer's), rank 1 delayed before its copy so that a barrier that does not wait is caught;
2. the same captured into one CUDA graph and replayed 300 times (is a stream wait capturable, and does
   a replayed barrier wait again);
3. what a waiting barrier costs a GEMM: 40 GEMMs (GPT 1b's MLP shape) on rank 0 alone, beside torch's
   barrier kernel waiting, and beside a stream wait waiting (rank 1 arrives ~150 ms later).

The barrier: rank r writes 1 into slot (s, r) of every peer's pad, waits until slot (s, p) of its
own pad is 1 for every peer p, and sets those back to 0. Consecutive barriers use different slots s,
so a peer's next signal into a slot comes after this rank's reset of it (the peer passed a later
barrier first, whose signal this rank wrote after the reset, behind the write's fence).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

def stream_barrier(handle):
    """fxshard's barrier of stream memory operations (fxshard/runtime/copy_engine.py `_stream_barrier`)
    on `handle`'s group, as barrier(slot). Session 27's run (bench/RESULTS.md) used this probe's own
    copy of the same protocol, from which that function was made."""
    from fxshard.runtime.copy_engine import _stream_barrier

    return lambda slot: _stream_barrier(handle, slot)


def exchange(handle, barrier, step_value, src, rank, world, n, delay_cycles):
    """One exchange on the current stream: src = step value, barrier 0, src -> peer's buffer at my rows,
    barrier 1, then the peer's rows of my buffer (should equal my step value: both count in lockstep)."""
    src.copy_(step_value.expand_as(src))
    barrier(0)
    if rank == 1:
        torch.cuda._sleep(delay_cycles)  # late: a barrier that does not wait lets rank 0 read stale rows
    for peer in range(world):
        if peer != rank:
            handle.get_buffer(peer, [world * n], torch.float32, 0)[rank * n:(rank + 1) * n].copy_(src)
    barrier(1)
    peer = 1 - rank
    return handle.get_buffer(rank, [world * n], torch.float32, 0)[peer * n:(peer + 1) * n]


def run(rank: int, world: int, port: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device)
    from torch.distributed import _symmetric_memory as symm

    result = {"rank": rank}
    try:
        group = dist.group.WORLD.group_name
        n = 1 << 16
        buf = symm.empty(world * n * 4 + (1 << 20), dtype=torch.uint8, device=device)
        torch.cuda.synchronize()
        handle = symm.rendezvous(buf, group)
        torch.cuda.synchronize()
        result["signal_pad_bytes"] = handle.signal_pad_size
        barrier = stream_barrier(handle)
        src = torch.empty(n, device=device)
        step_value = torch.zeros(1, device=device)
        errors = torch.zeros((), device=device, dtype=torch.int64)

        # 1. eager
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(300):
            step_value += 1
            got = exchange(handle, barrier, step_value, src, rank, world, n, 200_000)
            errors += (got != step_value).sum()
        torch.cuda.synchronize()
        result["eager_errors"] = int(errors.item())
        result["eager_s"] = time.perf_counter() - t0

        # 2. under a CUDA graph
        errors.zero_()
        step_value.zero_()
        side = torch.cuda.Stream()
        dist.barrier()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, stream=side):
                step_value += 1
                got = exchange(handle, barrier, step_value, src, rank, world, n, 200_000)
                errors += (got != step_value).sum()
            result["captured"] = True
        except Exception as error:  # noqa: BLE001 - the probe reports what failed
            result["captured"] = f"{type(error).__name__}: {error}"
        if result["captured"] is True:
            dist.barrier()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(300):
                graph.replay()
            torch.cuda.synchronize()
            result["graph_s"] = time.perf_counter() - t0
            result["graph_errors"] = int(errors.item())
            result["graph_steps"] = int(step_value.item())

        # 3. a GEMM beside a waiting barrier
        a = torch.randn(4096, 2048, device=device, dtype=torch.bfloat16)
        b = torch.randn(2048, 5632, device=device, dtype=torch.bfloat16)

        def gemms() -> float:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(40):
                a @ b
            end.record()
            end.synchronize()
            return start.elapsed_time(end)

        for _ in range(3):
            gemms()
        timings = {}
        for mode in ("alone", "torch-barrier", "stream-wait", "alone-again"):
            dist.barrier()
            torch.cuda.synchronize()
            if mode in ("torch-barrier", "stream-wait"):
                stream = torch.cuda.Stream()
                with torch.cuda.stream(stream):
                    if rank == 1:
                        torch.cuda._sleep(300_000_000)  # ~150 ms at 1.98 GHz: rank 0 waits that long
                    if mode == "torch-barrier":
                        handle.barrier(channel=0, timeout_ms=0)
                    else:
                        barrier(0)
                if rank == 0:
                    time.sleep(0.005)  # the wait is on the device before the GEMMs start
                    timings[mode] = gemms()
                torch.cuda.synchronize()
            elif rank == 0:
                timings[mode] = gemms()
        result["gemm_ms_40"] = timings
    except Exception as error:  # noqa: BLE001
        result["error"] = f"{type(error).__name__}: {error}"
    queue.put(result)
    queue.close()
    queue.join_thread()  # flushed before the hard exit
    os._exit(0)  # no process-group teardown: a broken barrier could leave a stream waiting


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    world = 2
    context = mp.get_context("spawn")
    queue = context.Queue()
    port = 29500 + os.getpid() % 1000
    procs = [context.Process(target=run, args=(r, world, port, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = []
    deadline = time.time() + 150
    while len(results) < world and time.time() < deadline:
        try:
            results.append(queue.get(timeout=5))
        except Exception:  # noqa: BLE001 - queue.Empty: keep waiting until the deadline
            if not any(p.is_alive() for p in procs):
                break
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
    results.sort(key=lambda r: r["rank"])
    print(json.dumps(results, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"date": time.strftime("%F"), "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                       "ranks": results}, f, indent=1)
    if len(results) < world:
        sys.exit("a rank did not report (hung or crashed)")


if __name__ == "__main__":
    main()
