"""Pipeline benchmark: 1F1B vs interleaved 1F1B for GPT 1b over P GPUs, measured bubble vs simulator.

    python bench/pipeline.py --gpus 4 --microbatches 8 --out bench/pipeline.json

Each rank times every forward and backward it runs with CUDA events on a clock shared through a
barrier at the step's start. Per schedule it prints ms/step, the measured bubble fraction (1 - a
rank's busy time / the step's makespan, averaged over ranks) and the simulator's prediction for the
same schedule given the measured mean forward and backward times of each chunk.
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
from fxshard.runtime import pipeline as runtime  # noqa: E402
from fxshard.schedule import simulate  # noqa: E402
from common import write_json  # noqa: E402

SCHEDULES = {"1f1b": ("1f1b", 1), "interleaved-v2": ("interleaved-1f1b", 2), "zb-h1": ("zb-h1", 1)}


class Timeline:
    """CUDA events around every F and B of this rank, relative to an event at the step's start."""

    def __init__(self):
        self.records = []
        self.origin = None

    def start(self):
        torch.cuda.synchronize()
        dist.barrier()
        self.origin = torch.cuda.Event(enable_timing=True)
        self.origin.record()
        self.records = []

    def wrap(self, method, kind):
        def timed(executor, c, mb):
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            method(executor, c, mb)
            end.record()
            self.records.append((kind, c, mb, begin, end))
        return timed

    def spans(self):
        torch.cuda.synchronize()
        return [(kind, c, mb, self.origin.elapsed_time(b), self.origin.elapsed_time(e))
                for kind, c, mb, b, e in self.records]


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
    timeline = Timeline()
    original = runtime.RankExecutor.forward, runtime.RankExecutor.backward
    runtime.RankExecutor.forward = timeline.wrap(original[0], "F")
    runtime.RankExecutor.backward = timeline.wrap(original[1], "B")
    weight = runtime.RankExecutor.weight_gradient
    runtime.RankExecutor.weight_gradient = timeline.wrap(weight, "W")
    try:
        for _ in range(warmup):
            step(data)
        step_ms, spans = [], []
        for _ in range(steps):
            timeline.start()
            started = time.perf_counter()
            step(data)
            torch.cuda.synchronize()
            step_ms.append((time.perf_counter() - started) * 1e3)
            spans.append(timeline.spans())
    finally:
        runtime.RankExecutor.forward, runtime.RankExecutor.backward = original
        runtime.RankExecutor.weight_gradient = weight
    gathered = [None] * world
    dist.all_gather_object(gathered, spans)
    peak = torch.cuda.max_memory_allocated()
    peaks = [None] * world
    dist.all_gather_object(peaks, peak)
    return {"schedule": step.schedule, "step_ms": step_ms, "spans": gathered, "peaks": peaks}


def analyse(result):
    """Measured bubble per step (compute spans of all ranks), and the simulator's prediction."""
    schedule = result["schedule"]
    ranks = len(result["spans"])
    measured, predicted, makespans = [], [], []
    for index in range(len(result["step_ms"])):
        per_rank = [result["spans"][r][index] for r in range(ranks)]
        begin = min(s[3] for spans in per_rank for s in spans)
        end = max(s[4] for spans in per_rank for s in spans)
        busy = [sum(s[4] - s[3] for s in spans) for spans in per_rank]
        measured.append(sum(1 - b / (end - begin) for b in busy) / ranks)
        makespans.append(end - begin)
        durations = {}
        for spans in per_rank:
            for kind, c, mb, start, stop in spans:
                durations.setdefault((kind, c), []).append(stop - start)
        cost = {f"{kind}{c}": sum(v) / len(v) for (kind, c), v in durations.items()}
        predicted.append(simulate(schedule, cost).bubble_fraction)
    return sum(measured) / len(measured), sum(predicted) / len(predicted), sum(makespans) / len(makespans)


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
    print(f"{'schedule':<16} {'ms/step':>9} {'compute span ms':>15} {'bubble measured':>15} "
          f"{'bubble simulated':>16} {'diff (pp)':>9} {'peak GiB':>9}", flush=True)
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
        measured, predicted, makespan = analyse(result)
        ms = sorted(result["step_ms"])[len(result["step_ms"]) // 2]
        row = {"schedule": name, "ms_per_step": ms, "compute_span_ms": makespan, "bubble_measured": measured,
               "bubble_simulated": predicted, "peak_bytes": max(result["peaks"]),
               "step_ms_all": result["step_ms"]}
        rows.append(row)
        print(f"{name:<16} {ms:>9.1f} {makespan:>15.1f} {measured:>15.1%} {predicted:>16.1%} "
              f"{(measured - predicted) * 100:>+9.1f} {row['peak_bytes'] / 2**30:>9.1f}", flush=True)
    write_json(args.out, gpus=args.gpus, microbatches=args.microbatches,
               rows=rows)


if __name__ == "__main__":
    main()
