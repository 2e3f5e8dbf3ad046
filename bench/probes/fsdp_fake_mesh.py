"""The compute a ZeRO-3 program adds over one GPU's program, without its communication, on one GPU.

    python bench/probes/fsdp_fake_mesh.py --out DIR [--batch 4]

`bench/fsdp.py --gpus 2 --batch 4` on 2x H200 (2026-11-24): fxshard ZeRO-3 112.5 ms/step, one GPU's
fxshard 104.8 ms (nocomm-compile 109.3). The 7.7 ms are communication left exposed, NCCL kernels
slowing compute down, or compute the sharded program has and one GPU's has not (casts, flat gradients,
copies out of gathered buffers). One GPU tells the last apart: a fake process group of `--world`
ranks (torch's FakeProcessGroup: collectives do nothing, their outputs are left as allocated) builds
rank 0's program of Mesh(dp=world), and it is timed and profiled next to the program without a mesh.
GPT 1b, S=2048, bench/fsdp.py's Config (bf16 compute, fp32 masters and reduce, AdamW, ZeRO-3, codegen,
CUDA graphs). Prints ms/step and kernel time by kind; writes DIR/fake_mesh.json and kernel tables.
"""

import argparse
import json
import os
import sys
import time
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import fxshard  # noqa: E402
from fxshard.models import GPT, GPTConfig  # noqa: E402
from moe_interleave import fake_world, time_and_profile  # noqa: E402


def kind(name: str) -> str:
    if name.startswith("triton_"):
        return "triton " + name.split("_")[1]
    if "nccl" in name.lower():
        return "nccl"
    if "memcpy" in name.lower() or "Memset" in name:
        return "copy/set"
    if any(k in name for k in ("nvjet", "gemm", "cutlass", "sm90_xmma")):
        return "gemm"
    if "flash" in name or "sdpa" in name or "fmha" in name:
        return "attention"
    if "adamw" in name.lower():
        return "adamw"
    return "other"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    fake_world(args.world)
    cfg = GPTConfig.preset("1b")
    generator = torch.Generator().manual_seed(0)
    data = {k: torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=generator).cuda()
            for k in ("idx", "tgt")}
    results = {}
    for label, mesh in (("one-gpu", None), (f"zero3-dp{args.world}-fake", fxshard.Mesh(dp=args.world))):
        torch.manual_seed(0)
        with torch.device("cuda"):
            model = GPT(cfg)
        config = fxshard.Config(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cuda_graphs=True,
                                sharding="optim_grads_params", dump_dir=os.path.join(args.out, f"dump-{label}"))
        started = time.perf_counter()
        step = fxshard.shard(model, lambda m, b: m.loss(b), data, optimizer=fxshard.optim.AdamW(lr=1e-4),
                             mesh=mesh, config=config)
        compile_s = time.perf_counter() - started
        del model
        ms, times, counts = time_and_profile(lambda: step(data), args.warmup, args.iters,
                                             os.path.join(args.out, f"{label}.txt"))
        kinds = defaultdict(lambda: [0.0, 0])
        for name, t in times.items():
            kinds[kind(name)][0] += t
            kinds[kind(name)][1] += counts[name]
        results[label] = {"ms_per_step": ms, "compile_s": compile_s, "kinds": dict(kinds), "kernel_ms": times,
                          "kernel_counts": counts}
        print(f"{label}: {ms:.2f} ms/step (compiled in {compile_s:.1f}s), GPU time {sum(times.values()):.2f} ms, "
              f"{sum(counts.values()):.0f} kernels/step", flush=True)
        for name, (t, n) in sorted(kinds.items(), key=lambda kv: -kv[1][0]):
            print(f"    {name:14s} {t:8.2f} ms  {n:6.0f} kernels", flush=True)
        step = None  # its CUDA graph and memory pool, before the next variant
        torch.cuda.empty_cache()
    with open(os.path.join(args.out, "fake_mesh.json"), "w") as handle:
        json.dump(results, handle, indent=1)


if __name__ == "__main__":
    sys.exit(main())
