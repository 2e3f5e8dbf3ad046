"""What the benchmarks share: the peak MFU is reported against, and how a result file is written."""

from __future__ import annotations

import datetime
import json
import os
import time

import torch

H200_BF16_DENSE_PEAK = 989e12  # dense bf16 FLOP/s of an H100 / H200 SXM: the denominator of every MFU here


def device_name() -> str:
    """The GPU's name, or "cpu" where there is none (the CPU smoke runs of a benchmark)."""
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def write_json(path: str, **fields) -> None:
    """`fields`, with the date, the GPU and torch's version first, as JSON at `path`; prints where."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as handle:
        json.dump({"date": datetime.date.today().isoformat(), "device": device_name(),
                   "torch": torch.__version__, **fields}, handle, indent=1)
    print(f"wrote {path}")


def timed(fn, warmup: int, iters: int) -> float:
    """ms per call of `fn` (a CUDA step) over `iters` calls after `warmup`."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - started) / iters * 1e3


def kernel_timeline(trace_path: str, steps: int, is_comm) -> dict:
    """From a profiler's chrome trace of `steps` steps: per step, how long the GPU ran any kernel, how long
    communication kernels (`is_comm(name)`) ran, how much of that other kernels ran alongside, and how much
    ran alone (exposed). Spans are unions over streams, so overlapping kernels count once."""
    with open(trace_path) as handle:
        kernels = [e for e in json.load(handle)["traceEvents"] if e.get("cat") == "kernel" and "dur" in e]
    comm = _union([(e["ts"], e["ts"] + e["dur"]) for e in kernels if is_comm(e["name"])])
    compute = _union([(e["ts"], e["ts"] + e["dur"]) for e in kernels
                      if not is_comm(e["name"]) and not e["name"].startswith("nccl")])
    busy = _union([(e["ts"], e["ts"] + e["dur"]) for e in kernels])
    overlapped = _intersection(comm, compute)

    def per_step(microseconds):
        return microseconds / steps / 1e3

    comm_ms = per_step(sum(b - a for a, b in comm))
    return {"gpu_busy_ms": per_step(sum(b - a for a, b in busy)), "comm_kernels_ms": comm_ms,
            "comm_overlapped_ms": per_step(overlapped), "comm_exposed_ms": comm_ms - per_step(overlapped)}


def _union(spans):
    merged = []
    for start, stop in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], stop)
        else:
            merged.append([start, stop])
    return merged


def _intersection(first, second) -> float:
    """Total length where two sorted lists of disjoint spans overlap."""
    total, i, j = 0.0, 0, 0
    while i < len(first) and j < len(second):
        (a, b), (c, d) = first[i], second[j]
        total += max(0.0, min(b, d) - max(a, c))
        if b < d:
            i += 1
        else:
            j += 1
    return total
