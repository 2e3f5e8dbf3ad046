"""Does a device-to-device copy on a side stream hold up the compute stream? One GPU.

    python bench/probes/dtod_stall.py [--copies 20] [--mb 64] [--out FILE.json]

Session 29 (2x H200, MoE ep=2, dual-batch, copy-engine all-to-alls with stream barriers): ~40 times a
step the compute stream sat idle for ~30 us, each time exactly while the side stream copied this rank's
own rows of an all-to-all into its region (`Memcpy DtoD`, ~33 us for 64 MB), and never while the peer's
rows went over NVLink (`Memcpy PtoP`, 174 us, beside compute). ~1.2 ms a step, about all that separates
the copy-engine step from the step without all-to-alls (bench/RESULTS.md, session 29). This probe asks
which side-stream work stalls a compute stream of short kernels, eagerly and in a CUDA graph:

- alone:       the compute stream only (a chain of `--chain` small elementwise kernels);
- memcpy:      beside it, `--copies` DtoD copies of `--mb` MB on a side stream (`Tensor.copy_`, what
               fxshard/runtime/copy_engine.py `_exchange` does for the own part);
- kernel-copy: the same bytes moved by an elementwise kernel on the side stream (holds SMs instead);
- memcpy+ops:  each copy preceded by a stream memory operation (cuStreamWriteValue32 into a device
               word, as the stream barriers and the marker write), in case the stall is theirs.

The compute chain is several times longer than all the copies, so a row's time above "alone" is what
the side stream held the compute stream up by (or slowed it: memory bandwidth). Prints a table and
writes JSON.

Session 30 (H200, torch 2.11, 20 x 64 MB beside 800 kernels): graphed, the chain alone took 0.82 ms and
1.75 ms beside the memcpys, as beside the elementwise copy kernel (1.74) and with the stream memory
operations (1.75); the copies alone took 0.70 ms. A same-device memcpy on a side stream holds the compute
stream up as a copy kernel does, so moving the own part later or by another copy cannot hide it (a
copy kernel of 16 thread blocks took 5.85 ms: 8x longer, and still in the way). Only not copying the own
part at all would.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))


def side_work(kind: str, sources, targets, word) -> None:
    from fxshard.runtime.copy_engine import _stream_memory_operations

    for src, dst in zip(sources, targets):
        if kind == "memcpy+ops":
            write, _ = _stream_memory_operations()
            write(torch.cuda.current_stream().cuda_stream, word.data_ptr(), 1, 0)
        if kind == "kernel-copy":
            torch.add(src, 0, out=dst)  # an elementwise kernel, not a memcpy
        else:
            dst.copy_(src)


def step(kind: str, chain: int, x, sources, targets, word, side) -> None:
    compute = torch.cuda.current_stream()
    if kind != "alone":
        side.wait_stream(compute)
        with torch.cuda.stream(side):
            side_work(kind, sources, targets, word)
    y = x
    for _ in range(chain):
        y = y * 1.0001 + 0.5  # two short kernels
    if kind != "alone":  # joining a stream that never forked from the capture would invalidate it
        compute.wait_stream(side)


def captured(kind: str, chain: int, x, sources, targets, word, side) -> torch.cuda.CUDAGraph:
    graph = torch.cuda.CUDAGraph()
    capture = torch.cuda.Stream()
    capture.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(capture), torch.cuda.graph(graph, stream=capture):
        step(kind, chain, x, sources, targets, word, side)
    torch.cuda.current_stream().wait_stream(capture)
    return graph


def timed(fn, repeats: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--copies", type=int, default=20)
    parser.add_argument("--mb", type=int, default=64)
    parser.add_argument("--chain", type=int, default=400, help="multiply-add pairs on the compute stream")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default="bench/probes/dtod_stall.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    numel = args.mb * 2**20 // 2
    sources = [torch.randn(numel, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
    sources = [sources[i % 2] for i in range(args.copies)]
    targets = [torch.empty(numel, dtype=torch.bfloat16, device="cuda") for _ in range(args.copies)]
    x = torch.randn(1 << 16, device="cuda")
    word = torch.zeros(1, dtype=torch.int32, device="cuda")
    side = torch.cuda.Stream()
    rows = []
    for kind in ("alone", "memcpy", "kernel-copy", "memcpy+ops"):
        eager = timed(lambda: step(kind, args.chain, x, sources, targets, word, side), args.repeats)
        try:
            graphed = timed(captured(kind, args.chain, x, sources, targets, word, side).replay, args.repeats)
        except Exception as error:  # one kind that cannot be captured must not cost the other rows
            print(f"{kind}: capture failed: {type(error).__name__}: {str(error).splitlines()[0]}", flush=True)
            torch.cuda.synchronize()
            graphed = float("nan")
        side_alone = timed(lambda: side_work(kind, sources, targets, word), args.repeats) if kind != "alone" else 0.0
        rows.append({"side": kind, "eager_ms": eager, "graphed_ms": graphed, "side_alone_ms": side_alone})
    base = rows[0]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}: compute chain of {2 * args.chain} kernels; "
          f"side: {args.copies} x {args.mb} MB")
    print(f"{'side stream':14s} {'eager ms':>9s} {'+ vs alone':>10s} {'graphed ms':>11s} {'+ vs alone':>10s} "
          f"{'side alone ms':>14s}")
    for row in rows:
        print(f"{row['side']:14s} {row['eager_ms']:9.3f} {row['eager_ms'] - base['eager_ms']:10.3f} "
              f"{row['graphed_ms']:11.3f} {row['graphed_ms'] - base['graphed_ms']:10.3f} {row['side_alone_ms']:14.3f}")
    print("a row's '+ vs alone' near 0: the side stream ran beside the chain; near its 'side alone': it held the chain up")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as handle:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "args": vars(args),
                   "rows": rows}, handle, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
