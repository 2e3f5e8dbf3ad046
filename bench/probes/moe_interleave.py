"""What microbatch interleaving costs in compute alone, on one GPU, for rank 0's ep=2 program.

    python bench/probes/moe_interleave.py --out DIR

`bench/moe.py --gpus 2 --ep 2 --microbatches 2 --interleave dual-batch` on 2x H200 (2026-11-24) found
nocomm-overlap1 3.1 ms slower than nocomm (56.9 ms) with codegen, where before codegen the interleave
cost 0.3 ms. Both are compute only (all-to-alls replaced by copies), so one GPU can measure them: a
fake process group of `--world` ranks (torch's FakeProcessGroup: collectives do nothing) builds rank 0's
program of Mesh(dp=world, ep=world) with bench/moe.py's model and Config, all-to-alls become copies
(bench/moe.py's nocomm), and each variant is timed and profiled:

    nocomm / nocomm-overlap1     ep_overlap off / on (ep_chunks=1, the --interleave pairing)
    each with codegen and without (aten replay)

Prints and writes DIR/interleave.json: ms/step, regions, kernels launched per step, and the kernel
names whose time differs most between nocomm and nocomm-overlap1 (DIR/<variant>.txt: kernel tables).
"""

import argparse
import dataclasses
import gc
import json
import os
import sys
import time
from collections import defaultdict

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import fxshard  # noqa: E402
from fxshard.models import MoEGPT, MoEGPTConfig  # noqa: E402
from fxshard.runtime import CompiledStep  # noqa: E402
from common import timed  # noqa: E402
from moe import without_all_to_all  # noqa: E402


def fake_world(world: int) -> None:
    """This process as rank 0 of `world` ranks whose collectives do nothing (torch's FakeProcessGroup),
    on GPU 0: rank 0's program of a mesh, built and run on one GPU."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    torch.cuda.set_device(0)


def time_and_profile(step_fn, warmup: int, iters: int, table_path: str, steps: int = 2):
    """ms per step over `iters` steps after `warmup`, then a CUDA profile of `steps` more: the kernel table
    into `table_path`, and per kernel name its GPU ms and launches per step."""
    from torch.profiler import ProfilerActivity, profile

    ms = timed(step_fn, warmup, iters)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step_fn()
        torch.cuda.synchronize()
    with open(table_path, "w") as handle:
        handle.write(prof.key_averages().table(sort_by="cuda_time_total", row_limit=80, max_name_column_width=100))
    times, counts = defaultdict(float), defaultdict(int)
    for event in prof.key_averages():
        times[event.key] += event.device_time_total / steps / 1e3
        counts[event.key] += event.count / steps
    return ms, dict(times), dict(counts)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--interleave", default="dual-batch", choices=fxshard.config.EP_INTERLEAVINGS)
    parser.add_argument("--no-aten", action="store_true", help="skip the variants without codegen")
    parser.add_argument("--unfused-grad-accumulation", action="store_true",
                        help="Config(fuse_grad_accumulation=False), the default before session 34")
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    fake_world(args.world)
    cfg = MoEGPTConfig(vocab_size=32000, d_model=2048, n_layer=args.layers, n_head=16, n_expert=64, top_k=8,
                       d_ff_expert=1024, d_ff_shared=None, capacity_factor=1.0, routing="balanced")
    generator = torch.Generator().manual_seed(0)
    data = {k: torch.randint(0, cfg.vocab_size, (2, 4096), generator=generator).cuda() for k in ("idx", "tgt")}
    results = {}
    codegens = [True] if args.no_aten else [True, False]
    variants = [(overlap, codegen) for codegen in codegens for overlap in (False, True)]
    for overlap, codegen in variants:
        label = ("nocomm-overlap1" if overlap else "nocomm") + ("" if codegen else "-aten")
        torch.manual_seed(0)
        with torch.device("cuda"):
            model = MoEGPT(cfg)
        config = fxshard.Config(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, sharding="optim",
                                cuda_graphs=True, ep_overlap=overlap, ep_chunks=1, microbatches=2,
                                ep_interleave=args.interleave, codegen="inductor" if codegen else None,
                                fuse_grad_accumulation=not args.unfused_grad_accumulation,
                                dump_dir=os.path.join(args.out, f"dump-{label}"))
        started = time.perf_counter()
        step = fxshard.shard(model, lambda m, b: m.loss_and_metrics(b), data, optimizer=fxshard.optim.AdamW(lr=1e-5),
                             mesh=fxshard.Mesh(dp=args.world, ep=args.world), config=config)
        compile_s = time.perf_counter() - started
        del model
        runner = CompiledStep([without_all_to_all(step.program)], step.state, step.batch_spec, step.optimizer,
                              step.device, step.groups,
                              dataclasses.replace(config, dump_dir=None, nonfinite="ignore"))
        ms, times, counts = time_and_profile(lambda: runner(data), args.warmup, args.iters,
                                             os.path.join(args.out, f"{label}.txt"))
        regions = len(runner.codegen.regions) if getattr(runner, "codegen", None) else 0
        results[label] = {"ms_per_step": ms, "compile_s": compile_s, "regions": regions,
                          "kernels_per_step": sum(counts.values()), "kernel_ms": times, "kernel_counts": counts}
        print(f"{label}: {ms:.2f} ms/step, compiled in {compile_s:.1f}s, {regions} regions, "
              f"{sum(counts.values()):.0f} kernels/step, GPU time {sum(times.values()):.2f} ms/step", flush=True)
        step = runner = None  # every CUDA graph and its memory pool, before the next variant
        gc.collect()
        torch.cuda.empty_cache()
    for suffix in ("", "-aten"):
        base, other = results.get("nocomm" + suffix), results.get("nocomm-overlap1" + suffix)
        if not base or not other:
            continue
        names = set(base["kernel_ms"]) | set(other["kernel_ms"])
        diff = sorted(((other["kernel_ms"].get(n, 0) - base["kernel_ms"].get(n, 0), n) for n in names), reverse=True)
        print(f"\nkernels costing more in nocomm-overlap1{suffix} than nocomm{suffix} (ms/step, count/step):")
        def counts(name):
            return f"{base['kernel_counts'].get(name, 0):5.0f} -> {other['kernel_counts'].get(name, 0):5.0f}"

        for delta, name in diff[:25]:
            print(f"  {delta:+7.3f}  {counts(name)}  {name[:110]}")
        print("  ... and the most saved:")
        for delta, name in diff[-8:]:
            print(f"  {delta:+7.3f}  {counts(name)}  {name[:110]}")
    with open(os.path.join(args.out, "interleave.json"), "w") as handle:
        json.dump(results, handle, indent=1)


if __name__ == "__main__":
    sys.exit(main())
