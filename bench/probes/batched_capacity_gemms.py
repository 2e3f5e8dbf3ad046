"""Probe: the expert MLP's six GEMMs when every expert has the same number of rows (a capacity-slot
layout: expert e owns rows [e*C, (e+1)*C), underfull slots padded with zero rows) as cuBLAS batched
GEMMs (torch.bmm on [E, C, .] views), next to torch._grouped_mm on the same uniform offsets and on
random (ragged, dropless) routing of the same T = E*C rows. Measures how much of the grouped GEMMs'
gap to the dense rate a fixed-capacity layout would recover (bench/RESULTS.md, 2026-11-23: the six
grouped GEMMs reach 80.0% / 76.4% of dense at the bench's shapes).

    python3 bench/probes/batched_capacity_gemms.py
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from grouped_gemm_parts import median_ms  # noqa: E402

SHAPES = [(8, 2048, 2048, 1408), (64, 1024, 2048, 768)]  # (E, C, D, F): T = E*C as in the bench


def six_gemms(x, a, gy, gh, w1, w2, offs, batched):
    """fc1 fwd, fc2 fwd, fc2 data grad, fc1 data grad, fc1 weight grad, fc2 weight grad."""
    gm = torch._grouped_mm
    if batched:
        E = w1.shape[0]
        xb, ab, gyb, ghb = (t.view(E, -1, t.shape[-1]) for t in (x, a, gy, gh))
        return {"fc1 fwd": lambda: torch.bmm(xb, w1.transpose(1, 2)),
                "fc2 fwd": lambda: torch.bmm(ab, w2.transpose(1, 2)),
                "fc2 dgrad": lambda: torch.bmm(gyb, w2),
                "fc1 dgrad": lambda: torch.bmm(ghb, w1),
                "fc1 wgrad": lambda: torch.bmm(ghb.transpose(1, 2), xb),
                "fc2 wgrad": lambda: torch.bmm(gyb.transpose(1, 2), ab)}
    return {"fc1 fwd": lambda: gm(x, w1.transpose(1, 2), offs=offs),
            "fc2 fwd": lambda: gm(a, w2.transpose(1, 2), offs=offs),
            "fc2 dgrad": lambda: gm(gy, w2, offs=offs),
            "fc1 dgrad": lambda: gm(gh, w1, offs=offs),
            "fc1 wgrad": lambda: gm(gh.t(), x, offs=offs),
            "fc2 wgrad": lambda: gm(gy.t(), a, offs=offs)}


def main():
    a_ = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    dense = 2 * 8192 ** 3 / median_ms(lambda: a_ @ a_) / 1e9
    print(f"{torch.cuda.get_device_name()}: dense bf16 8192^3 {dense:.0f} TFLOP/s", flush=True)
    for E, C, D, F in SHAPES:
        T = E * C
        g = torch.Generator(device="cuda").manual_seed(0)
        bf = dict(device="cuda", dtype=torch.bfloat16)
        x, gy = torch.randn(T, D, **bf, generator=g), torch.randn(T, D, **bf, generator=g)
        a, gh = torch.randn(T, F, **bf, generator=g), torch.randn(T, 2 * F, **bf, generator=g)
        w1 = torch.randn(E, 2 * F, D, **bf, generator=g) * 0.02
        w2 = torch.randn(E, D, F, **bf, generator=g) * 0.02
        uniform = torch.arange(1, E + 1, device="cuda", dtype=torch.int32) * C
        ragged = torch.bincount(torch.randint(0, E, (T,), device="cuda", generator=g),
                                minlength=E).cumsum(0).to(torch.int32)
        runs = {"bmm": six_gemms(x, a, gy, gh, w1, w2, None, True),
                "grouped uniform": six_gemms(x, a, gy, gh, w1, w2, uniform, False),
                "grouped ragged": six_gemms(x, a, gy, gh, w1, w2, ragged, False)}
        flops = {"fc1 fwd": 2 * T * D * 2 * F, "fc2 fwd": 2 * T * F * D, "fc2 dgrad": 2 * T * D * F,
                 "fc1 dgrad": 2 * T * 2 * F * D, "fc1 wgrad": 2 * T * 2 * F * D, "fc2 wgrad": 2 * T * D * F}
        bmm = runs["bmm"]
        for name, fn in runs["grouped uniform"].items():
            ours, theirs = bmm[name]().float(), fn().view(bmm[name]().shape).float()
            error = ((ours - theirs).norm() / theirs.norm()).item()
            print(f"E={E} C={C} {name}: |bmm - grouped (uniform offsets)| / |grouped| = {error:.1e}", flush=True)
        for kind, gemms in runs.items():
            total = 0.0
            cells = []
            for name, fn in gemms.items():
                ms = median_ms(fn)
                total += ms
                cells.append(f"{name} {ms:.3f} ({flops[name] / ms / 1e9:.0f})")
            print(f"E={E} C={C} D={D} F={F} {kind:<16}: sum {total:.3f} ms = "
                  f"{sum(flops.values()) / total / 1e9:.0f} TFLOP/s = {sum(flops.values()) / total / 1e9 / dense:.1%} of dense; "
                  + ", ".join(cells), flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
