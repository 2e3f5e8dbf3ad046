"""Pipeline benchmark: 1F1B, interleaved 1F1B and ZB-H1 for GPT 1b over P GPUs.

    python bench/pipeline.py --gpus 2 --microbatches 8 --out bench/pipeline.json

Each schedule is lowered into one program per stage (passes/lower_schedule.py) and run by
CompiledStep. Per schedule it prints ms/step (median), tokens/s and the simulator's bubble for the
schedule with backward = 2x forward. The measured bubble needs per-action timing inside the one
executable (CUDA events recorded by graph nodes at action boundaries), which is not built yet.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import fxshard  # noqa: E402
from fxshard.launch import run_local  # noqa: E402
from fxshard.models import GPT, GPTConfig  # noqa: E402
from fxshard.schedule import build, simulate  # noqa: E402
from common import write_json  # noqa: E402

SCHEDULES = {"1f1b": ("1f1b", 1), "interleaved-v2": ("interleaved-1f1b", 2), "zb-h1": ("zb-h1", 1)}


def run(name, microbatches, batch, seq, steps, warmup):
    rank, world = dist.get_rank(), dist.get_world_size()
    device = f"cuda:{rank}"
    torch.cuda.set_device(device)
    schedule_name, virtual = SCHEDULES[name]
    cfg = GPTConfig.preset("1b")
    torch.manual_seed(0)
    with torch.device(device):
        model = GPT(cfg)
    generator = torch.Generator().manual_seed(0)
    data = {"idx": torch.randint(0, cfg.vocab_size, (batch * microbatches, seq), generator=generator).to(device),
            "tgt": torch.randint(0, cfg.vocab_size, (batch * microbatches, seq), generator=generator).to(device)}
    config = fxshard.Config(schedule=schedule_name, virtual_stages=virtual, microbatches=microbatches,
                            param_dtype=torch.bfloat16, reduce_dtype=torch.float32, sharding="no_shard")
    step = fxshard.shard(model, lambda m, b: m.loss(b), data, optimizer=fxshard.optim.AdamW(lr=1e-4),
                         mesh=fxshard.Mesh(pp=world), config=config)
    del model
    torch.cuda.empty_cache()
    for _ in range(warmup):
        step(data)
    step_ms = []
    for _ in range(steps):
        torch.cuda.synchronize()
        dist.barrier()
        started = time.perf_counter()
        step(data)
        torch.cuda.synchronize()
        step_ms.append((time.perf_counter() - started) * 1e3)
    peaks = [None] * world
    dist.all_gather_object(peaks, torch.cuda.max_memory_allocated())
    return {"step_ms": step_ms, "peaks": peaks}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--batch", type=int, default=1, help="sequences per microbatch")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--schedules", nargs="+", default=list(SCHEDULES))
    parser.add_argument("--out", default="bench/pipeline.json")
    args = parser.parse_args()
    print(f"GPT 1b, pp={args.gpus}, M={args.microbatches}, microbatch {args.batch}x{args.seq}, "
          f"{torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    print(f"{'schedule':<16} {'ms/step':>9} {'tokens/s':>10} {'bubble simulated':>16} {'peak GiB':>9}", flush=True)
    rows = []
    for name in args.schedules:
        started = time.perf_counter()
        try:
            result = run_local(run, args.gpus, name, args.microbatches, args.batch, args.seq, args.steps,
                               args.warmup, backend="nccl")[0]
        except Exception as error:  # report and go on
            print(f"{name:<16} failed after {time.perf_counter() - started:.0f}s: {type(error).__name__}: "
                  f"{str(error)[:300]}", flush=True)
            continue
        schedule_name, virtual = SCHEDULES[name]
        predicted = simulate(build(schedule_name, args.gpus, args.microbatches, virtual),
                             {"F": 1.0, "B": 2.0}).bubble_fraction
        ms = sorted(result["step_ms"])[len(result["step_ms"]) // 2]
        tokens = args.microbatches * args.batch * args.seq / (ms / 1e3)
        row = {"schedule": name, "ms_per_step": ms, "tokens_per_s": tokens, "bubble_simulated": predicted,
               "peak_bytes": max(result["peaks"]), "step_ms_all": result["step_ms"]}
        rows.append(row)
        print(f"{name:<16} {ms:>9.1f} {tokens:>10.0f} {predicted:>16.1%} {row['peak_bytes'] / 2**30:>9.1f}",
              flush=True)
    write_json(args.out, gpus=args.gpus, microbatches=args.microbatches,
               rows=rows)


if __name__ == "__main__":
    main()
