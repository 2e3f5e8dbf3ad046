"""Probe: where does the grouped expert MLP's forward+backward lose against the dense matmul rate?

Times each of the six grouped GEMMs of a SwiGLU expert MLP on its own (CUDA-graph replay, median),
in the layout fxshard uses, in alternative operand layouts, as one dense matmul of the same total
size (the rate a perfect grouped kernel could reach at that shape), and, with --inductor, Inductor's
autotuned Triton grouped-GEMM template next to aten's. Prints a table; --out writes JSON.

    python3 bench/probes/grouped_gemm_parts.py [--inductor] [--out parts.json]
"""

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from grouped_mlp import graphed  # noqa: E402  (bench/grouped_mlp.py)

SHAPES = [(8, 16384, 2048, 1408), (64, 65536, 2048, 768)]


def median_ms(fn, iters=20):
    """Median ms of one replay of `fn` captured in a CUDA graph."""
    replay = graphed(fn)
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def gemms(E, T, D, F, seed=0):
    """name -> (flops, {variant: fn})."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    choice = torch.randint(0, E, (T,), device="cuda", generator=g)
    offs = torch.bincount(choice, minlength=E).cumsum(0).to(torch.int32)
    bf = dict(device="cuda", dtype=torch.bfloat16)
    H = 2 * F
    x = torch.randn(T, D, **bf, generator=g)
    a = torch.randn(T, F, **bf, generator=g)
    gy = torch.randn(T, D, **bf, generator=g)
    gh = torch.randn(T, H, **bf, generator=g)
    w1 = torch.randn(E, H, D, **bf, generator=g) * 0.02
    w2 = torch.randn(E, D, F, **bf, generator=g) * 0.02
    w1_t = w1.transpose(1, 2).contiguous()  # [E, D, H]
    w2_t = w2.transpose(1, 2).contiguous()  # [E, F, D]
    gm = torch._grouped_mm

    def dense(m, k, n):
        p, q = torch.randn(m, k, **bf), torch.randn(n, k, **bf)
        return lambda: p @ q.t()

    return {
        "fwd fc1 x@w1T": (2 * T * D * H, {
            "fxshard": lambda: gm(x, w1.transpose(1, 2), offs=offs),
            "w1 row-major B": lambda: gm(x, w1_t, offs=offs),
            "dense": dense(T, D, H)}),
        "fwd fc2 a@w2T": (2 * T * F * D, {
            "fxshard": lambda: gm(a, w2.transpose(1, 2), offs=offs),
            "w2 row-major B": lambda: gm(a, w2_t, offs=offs),
            "dense": dense(T, F, D)}),
        "dgrad fc2 gy@w2": (2 * T * D * F, {
            "fxshard": lambda: gm(gy, w2, offs=offs),
            "w2T K-major B": lambda: gm(gy, w2_t.transpose(1, 2), offs=offs),
            "dense": dense(T, D, F)}),
        "dgrad fc1 gh@w1": (2 * T * H * D, {
            "fxshard": lambda: gm(gh, w1, offs=offs),
            "w1T K-major B": lambda: gm(gh, w1_t.transpose(1, 2), offs=offs),
            "dense": dense(T, H, D)}),
        "wgrad fc1 ghT@x": (2 * T * H * D, {
            "fxshard": lambda: gm(gh.t(), x, offs=offs),
            "transposed xT@gh": lambda: gm(x.t(), gh, offs=offs),
            "dense": dense(H, T, D)}),
        "wgrad fc2 gyT@a": (2 * T * D * F, {
            "fxshard": lambda: gm(gy.t(), a, offs=offs),
            "transposed aT@gy": lambda: gm(a.t(), gy, offs=offs),
            "dense": dense(D, T, F)}),
    }, (x, a, gy, gh, w1, w2, offs)


def inductor_rates(E, T, D, F, operands, budget_s):
    import torch._inductor.config as cfg

    cfg.max_autotune_gemm_backends = "ATEN,TRITON"
    x, a, gy, gh, w1, w2, offs = operands
    gm = torch._grouped_mm
    cases = {
        "fwd fc1 x@w1T": (lambda x, w1, offs: gm(x, w1.transpose(1, 2), offs=offs), (x, w1, offs), 2 * T * D * 2 * F),
        "dgrad fc1 gh@w1": (lambda gh, w1, offs: gm(gh, w1, offs=offs), (gh, w1, offs), 2 * T * 2 * F * D),
        "wgrad fc1 ghT@x": (lambda gh, x, offs: gm(gh.t(), x, offs=offs), (gh, x, offs), 2 * T * 2 * F * D),
        "fwd fc2 a@w2T": (lambda a, w2, offs: gm(a, w2.transpose(1, 2), offs=offs), (a, w2, offs), 2 * T * F * D),
    }
    out = {}
    start = time.time()
    for name, (fn, args, flops) in cases.items():
        if time.time() - start > budget_s:
            print(f"inductor: budget spent, skipping {name}", flush=True)
            continue
        torch._dynamo.reset()
        compiled = torch.compile(fn, mode="max-autotune-no-cudagraphs", dynamic=False)
        t0 = time.time()
        compiled(*args)
        ms = median_ms(lambda: compiled(*args))
        out[name] = ms
        print(f"inductor {E}/{T}/{D}/{F} {name:<18} {ms:8.3f} ms {flops / ms / 1e9:6.0f} TFLOP/s "
              f"(compile+tune {time.time() - t0:.0f} s)", flush=True)
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--inductor", action="store_true")
    parser.add_argument("--inductor-budget", type=float, default=240)
    parser.add_argument("--out")
    args = parser.parse_args()
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    dense_ms = median_ms(lambda: a @ a)
    print(f"{torch.cuda.get_device_name()}: dense 8192^3 {2 * 8192 ** 3 / dense_ms / 1e9:.0f} TFLOP/s", flush=True)
    rows = []
    for shape in SHAPES:
        table, operands = gemms(*shape)
        for name, (flops, variants) in table.items():
            for variant, fn in variants.items():
                ms = median_ms(fn)
                rows.append(dict(shape=shape, gemm=name, variant=variant, ms=ms, tflops=flops / ms / 1e9))
                print(f"{'/'.join(map(str, shape)):<20} {name:<18} {variant:<18} {ms:8.3f} ms "
                      f"{flops / ms / 1e9:6.0f} TFLOP/s", flush=True)
        if args.inductor:
            rows.append(dict(shape=shape, inductor=inductor_rates(*shape, operands, args.inductor_budget)))
        del table, operands
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(rows, handle, indent=1)


if __name__ == "__main__":
    main()
