"""MoE training step on one GPU: expert rows packed (grouped GEMMs) vs in capacity slots (batched GEMMs).

    python bench/moe_slots.py --out bench/moe_slots.json

One MoEGPT (bf16 compute, fp32 masters, AdamW), fused expert MLPs (Config(fuse_grouped_mlp=True)),
steps replayed from CUDA graphs, three routings of the same model and batch, timed in turns (a GPU's
clocks drift under sustained load; see bench/RESULTS.md):

    dropless   capacity_factor=None: every assignment kept, rows packed by expert (ragged groups)
    packed     capacity_factor=C: at most C rows per expert, rows packed (ragged groups)
    slots      the same capacity, rows in C-row slots (MoEGPTConfig(expert_slots=True)): each
               expert GEMM is one batched GEMM over [E, C, .], the padding computed and ignored

`--modes` picks some (the first is the baseline of the "vs" column). `packed` and `slots` keep and drop the same assignments, so they train the same model (their losses
agree to bf16 noise; printed); `dropless` is the default routing, for reference. "kept/slots" is the
share of the E*C slot rows that hold a kept assignment (averaged over layers, last warm-up
step): the batched GEMMs compute every slot row, the grouped GEMMs only kept ones, so slots pay off
when experts are well filled (a router that balances its load) and lose when they are not. Prints a
table and writes JSON.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

import fxshard  # noqa: E402
from fxshard.models import MoEGPT, MoEGPTConfig  # noqa: E402
from grouped_mlp import timed_in_turns  # noqa: E402  (bench/grouped_mlp.py)
from common import write_json  # noqa: E402

MODES = {"dropless": dict(capacity_factor=None), "packed": dict(expert_slots=False),
         "slots": dict(expert_slots=True)}


def build(args, mode, batch):
    torch.manual_seed(0)
    overrides = {"capacity_factor": args.capacity_factor, **MODES[mode]}
    cfg = MoEGPTConfig(vocab_size=32000, d_model=args.hidden, n_layer=args.layers, n_head=16, n_expert=args.experts,
                       top_k=args.top_k, d_ff_expert=args.d_ff, d_ff_shared=None, **overrides)
    model = MoEGPT(cfg).cuda()
    step = fxshard.shard(model, lambda m, b: m.loss_and_metrics(b), batch, optimizer=fxshard.optim.AdamW(lr=1e-4),
                         config=fxshard.Config(fuse_grouped_mlp=True, cuda_graphs=True, param_dtype=torch.bfloat16,
                                               reduce_dtype=torch.float32))
    return step


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--d-ff", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=2, help="sequences per step")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--capacity-factor", type=float, default=1.0)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--blocks", type=int, default=6, help="timed turns per mode (median)")
    parser.add_argument("--profile", metavar="DIR", help="kernel-time tables of two steps of each mode")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--out", default="bench/moe_slots.json")
    args = parser.parse_args()
    generator = torch.Generator().manual_seed(1)
    batch = {k: torch.randint(0, 32000, (args.batch, args.seq), generator=generator).cuda() for k in ("idx", "tgt")}
    tokens = args.batch * args.seq
    steps, losses, fill = {}, {}, {}
    capacity = -(-int(args.capacity_factor * tokens * args.top_k) // args.experts)
    for mode in args.modes:
        print(f"compiling {mode} ...", flush=True)
        steps[mode] = build(args, mode, batch)
        metrics = [steps[mode](batch) for _ in range(args.warmup)]
        losses[mode] = [m["loss"].item() for m in metrics]
        kept = tokens * args.top_k - metrics[-1]["moe_dropped_tokens"].item() / args.layers
        fill[mode] = kept / (args.experts * capacity)  # of the slots' rows: what batched GEMMs compute usefully
    names = list(steps)
    times = timed_in_turns({mode: (lambda step=step: step(batch)) for mode, step in steps.items()}, args.iters,
                           args.blocks)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}: MoEGPT {args.layers} layers, hidden "
          f"{args.hidden}, {args.experts} experts x {args.d_ff}, top-{args.top_k}, {tokens} tokens per step, "
          f"capacity factor {args.capacity_factor} (packed, slots)")
    base = names[0]
    print(f"{'mode':<22} {'step ms':>9} {'tokens/s':>10} {'vs ' + base:>12} {'kept/slots':>10}  first losses")
    rows = []
    median = {mode: sorted(t)[len(t) // 2] for mode, t in times.items()}
    for mode in names:
        row = {"mode": mode, "step_ms": median[mode], "tokens_per_s": tokens / median[mode] * 1e3,
               "speedup_vs_first": median[base] / median[mode], "kept_over_slot_rows": fill[mode],
               "losses": losses[mode], "times": times[mode]}
        rows.append(row)
        print(f"{mode:<22} {median[mode]:>9.2f} {row['tokens_per_s']:>10.0f} {row['speedup_vs_first']:>11.2f}x "
              f"{fill[mode]:>10.1%}  {', '.join(f'{x:.4f}' for x in losses[mode])}")
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        os.makedirs(args.profile, exist_ok=True)
        for mode, step in steps.items():
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(2):
                    step(batch)
                torch.cuda.synchronize()
            with open(os.path.join(args.profile, f"{mode}.txt"), "w") as handle:
                handle.write(prof.key_averages().table(sort_by="cuda_time_total", row_limit=40,
                                                       max_name_column_width=100))
    write_json(args.out, args=vars(args), rows=rows)


if __name__ == "__main__":
    main()
