"""Can an all-to-all's consumer read the own part from the input instead of the region? One GPU.

    python bench/probes/cat_gather.py [--rows 32768] [--width 2048] [--out FILE.json]

A copy-engine all-to-all copies this rank's own rows into its region before its consumer reads the
region (fxshard/runtime/copy_engine.py `_exchange`): ~0.8 ms a step in the MoE benchmark, a cost the
step without all-to-alls does not pay (bench/RESULTS.md, sessions 30-31). Every consumer in the EP
pass is an Inductor gather (`index_select` by the receive order, or the unpack's gather by slot), so
the exchange could skip the own part and the consumer read `cat([region peers, input own rows])`,
if Inductor fuses that `cat` into the gather's loads instead of writing it out first. On CPU it does
not (lowering.py `cat`: always a ConcatKernel there); on CUDA it takes `pointwise_cat` when every input
would need a copy anyway, which graph inputs do. This probe checks that on the GPU, two ranks' worth
of rows (`--rows` each half), bf16:

- gather:         `region.index_select(0, order)`: today's consumer, the floor;
- copy + gather:  the own half copied into the region first, then the gather (today's total);
- cat gather:     `cat([region[:n], input[n:]]).index_select(0, order)`, compiled: the candidate.

Each compiled by Inductor, timed in a CUDA graph. Prints the times, whether the compiled cat gather's
code allocates a [2n, width] buffer (the cat written out), and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from grouped_mlp import cuda_time_ms, graphed  # noqa: E402  (bench/grouped_mlp.py)


def timed(fn, iters: int = 50) -> float:
    """Mean ms of one call of `fn` replayed from a CUDA graph (one warm-up replay, one block of `iters`)."""
    return cuda_time_ms(graphed(fn), warmup=1, iters=iters, blocks=1)


def materialized_cat(codes: list[str], rows: int, width: int) -> bool:
    """Whether Inductor's code allocates a second [rows, width] buffer besides the gather's result:
    the cat written out before the gather reads it."""
    shape = f"(({rows}, {width}), "
    return sum(line.count(shape) for code in codes for line in code.splitlines() if "empty_strided" in line) >= 2


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=32768, help="rows of the region (both ranks' parts)")
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a GPU")
        return 1
    from torch._inductor.utils import run_and_get_code

    rows, n = args.rows, args.rows // 2
    region = torch.randn(rows, args.width, device="cuda", dtype=torch.bfloat16)
    own = torch.randn(rows, args.width, device="cuda", dtype=torch.bfloat16)
    order = torch.randperm(rows, device="cuda")

    def gather(region, order):
        return region.index_select(0, order)

    def cat_gather(region, own, order):
        return torch.cat([region[:n], own[n:]]).index_select(0, order)

    compiled_gather = torch.compile(gather)
    compiled_cat = torch.compile(cat_gather)
    _, codes = run_and_get_code(compiled_cat, region, own, order)
    materialized = materialized_cat(codes, rows, args.width)
    expected = torch.cat([region[:n], own[n:]]).index_select(0, order)
    exact = torch.equal(compiled_cat(region, own, order), expected)

    def copy_then_gather():
        region[n:].copy_(own[n:])
        return compiled_gather(region, order)

    times = {"gather": timed(lambda: compiled_gather(region, order)),
             "copy + gather": timed(copy_then_gather),
             "cat gather": timed(lambda: compiled_cat(region, own, order))}
    print(f"{rows} rows x {args.width} bf16, {torch.cuda.get_device_name()}, torch {torch.__version__}")
    for name, ms in times.items():
        print(f"  {name:<14} {ms * 1e3:8.1f} us")
    print(f"  cat written out first: {materialized}; cat gather equals eager: {exact}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"rows": rows, "width": args.width, "device": torch.cuda.get_device_name(),
                       "torch": torch.__version__, "us": {k: v * 1e3 for k, v in times.items()},
                       "materialized": materialized, "exact": exact}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
