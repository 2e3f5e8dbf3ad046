"""What a call of one of fxshard's ops costs the host: through the dispatcher against its body.

    python bench/probes/op_dispatch.py [--device cuda|cpu] [--calls 2000] [--out FILE.json]

An eager replay is bound by its host (bench/RESULTS.md, session 41: 100-200 ms of CPU a step for
~110 ms of GPU work on a pipeline stage of GPT 1b), and it calls fxshard's own ops ~450 times a step.
The runtime calls them as their Python bodies (fxshard/runtime/direct_calls.py). This probe times
each op the replay calls most, on small tensors so that the host's time is all there is to see: the
op through `torch.ops.fxshard.<name>.default`, then its body, `--calls` calls each after a warm-up,
best of 5 blocks, the device synchronized after each block (the time the host spent issuing them is
what is left over a GPU kernel of a few microseconds). Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import fxshard  # noqa: E402,F401  (registers the ops)
from fxshard.runtime.direct_calls import body_of  # noqa: E402


def per_call_us(fn, calls: int, device: str) -> float:
    """Best of 5 blocks of `calls` calls of `fn`, in microseconds a call."""
    for _ in range(50):
        fn()
    best = float("inf")
    for _ in range(5):
        if device == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(calls):
            fn()
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - started) / calls * 1e6)
    return best


def cases(device: str) -> dict[str, tuple]:
    """op name -> its arguments, bf16 inputs and fp32 totals as a pipeline stage's gradients are."""
    a = torch.randn(8, 16, device=device, dtype=torch.bfloat16)
    b = torch.randn(16, 8, device=device, dtype=torch.bfloat16)
    total, flat = torch.zeros(8, 8, device=device), torch.zeros(256, device=device)
    param, grad = torch.randn(64, device=device), torch.randn(64, device=device)
    moments = (torch.zeros(64, device=device), torch.zeros(64, device=device))
    scalar = lambda value: torch.full((), value, device=device)  # noqa: E731
    return {
        "matmul_accumulate_at_": (flat, 64, a, b),
        "matmul_wide_at_": (flat, 128, a, b),
        "matmul_accumulate_": (total, a, b),
        "copy_at_": (flat, 0, total),
        # param, grad, moments, decay, step size, sqrt of the second bias correction, beta1, beta2, eps
        "adamw_update_": (param, grad, *moments, scalar(0.9999), scalar(1e-3), scalar(0.5), 0.9, 0.95, 1e-8),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--out", default="bench/op_dispatch.json")
    args = parser.parse_args()
    rows = []
    print(f"{'op':<24} {'dispatched us':>13} {'body us':>8} {'saved us':>9}")
    for name, arguments in cases(args.device).items():
        op = getattr(torch.ops.fxshard, name).default
        body = body_of(op)
        if body is None:
            print(f"{name:<24} not called directly (direct_calls.body_of)")
            continue
        try:
            dispatched = per_call_us(lambda: op(*arguments), args.calls, args.device)
            direct = per_call_us(lambda: body(*arguments), args.calls, args.device)
        except TypeError as error:  # an op whose signature changed: say so, time the others
            print(f"{name:<24} skipped: {error}")
            continue
        rows.append({"op": name, "dispatched_us": dispatched, "body_us": direct})
        print(f"{name:<24} {dispatched:>13.1f} {direct:>8.1f} {dispatched - direct:>9.1f}", flush=True)
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    with open(args.out, "w") as f:
        json.dump({"device": device, "torch": torch.__version__, "calls": args.calls, "rows": rows}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
