"""What the non-finite guard and the evaluation step cost: one GPU, side by side in one job.

    python bench/guard.py --model 1b --batch 1 --out bench/guard.json

Trains the same GPT (bf16 compute, fp32 masters, AdamW, no mesh) with Config(nonfinite=) "ignore"
(no guard), "skip" (the guard, no host read) and "raise" (the guard, and each call reads the last
step's flag, so the host cannot run ahead of the GPU by more than one step), each with CUDA graphs
and with eager replay (aten, codegen off in both: the guard's cost is the same kernels either way).
Then times `step.evaluate(batch)` against a training step, once per replay kind (its first call
compiles; with CUDA graphs that call also captures it, and later calls replay the graph).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import fxshard  # noqa: E402
from fxshard.models import GPT, GPTConfig  # noqa: E402
from common import timed, write_json  # noqa: E402
from fsdp import batch_for  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="1b")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--modes", nargs="+", default=["ignore", "skip", "raise"],
                        help="in this order (repeat one to see run-to-run spread)")
    parser.add_argument("--replays", nargs="+", default=["graphs", "eager"], choices=["graphs", "eager"])
    parser.add_argument("--out", default="bench/guard.json")
    args = parser.parse_args()
    cfg = GPTConfig.preset(args.model)
    data = batch_for(cfg, args.batch, args.seq, "cuda")
    optimizer = fxshard.optim.AdamW(lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
    rows = []
    evaluated = set()
    for graphs in [replay == "graphs" for replay in args.replays]:
        for mode in args.modes:
            torch.manual_seed(0)
            with torch.device("cuda"):
                model = GPT(cfg)
            step = fxshard.shard(model, lambda m, b: m.loss(b), data, optimizer=optimizer,
                                 config=fxshard.Config(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                                       cuda_graphs=graphs, codegen=None, nonfinite=mode))
            ms = timed(lambda: step(data), args.warmup, args.iters)
            row = {"replay": "cuda graphs" if graphs else "eager", "nonfinite": mode, "ms": round(ms, 2)}
            if graphs not in evaluated:  # the evaluation step, on the same state, once per replay kind
                evaluated.add(graphs)
                started = time.perf_counter()
                step.evaluate(data)
                torch.cuda.synchronize()
                row["evaluate_first_call_s"] = round(time.perf_counter() - started, 2)
                row["evaluate_ms"] = round(timed(lambda: step.evaluate(data), 2, args.iters), 2)
            rows.append(row)
            print(row, flush=True)
            step = model = None  # frees the state before the next mode
            torch.cuda.empty_cache()
    base = {r["replay"]: r["ms"] for r in reversed(rows) if r["nonfinite"] == "ignore"}  # the first "ignore" run
    print(f"\nGPT {args.model}, batch {args.batch} x {args.seq}, one {torch.cuda.get_device_name()}")
    print(f"{'replay':<12} {'nonfinite':<9} {'ms/step':>8} {'vs ignore':>9}  (the first ignore run of the replay)")
    for r in rows:
        ratio = f"{r['ms'] / base[r['replay']]:>9.3f}" if r["replay"] in base else f"{'-':>9}"
        print(f"{r['replay']:<12} {r['nonfinite']:<9} {r['ms']:>8.2f} {ratio}")
    for evaluation in (r for r in rows if "evaluate_ms" in r):
        print(f"evaluate ({evaluation['replay']}, codegen off): {evaluation['evaluate_ms']:.2f} ms, first call "
              f"{evaluation['evaluate_first_call_s']:.1f} s (compiles)")
    write_json(args.out, model=args.model, batch=args.batch, seq=args.seq, command=" ".join(sys.argv), rows=rows)


if __name__ == "__main__":
    main()
