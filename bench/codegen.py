"""Codegen compile time and step time on one GPU: fxshard.shard with Inductor codegen, cold and warm.

    python bench/codegen.py --models gpt-1b moe-1b --out bench/codegen.json

For each model it runs `fxshard.shard` (trace, passes, codegen) in a fresh process twice: first
with an empty Inductor cache (cold), then with the cache the first run left (warm), and reports
shard() seconds, the codegen summary (regions compiled, cache hits, fallbacks) and the step time
with and without codegen (bf16 compute, fp32 masters, AdamW, CUDA graphs, batch 1 x 2048).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from common import write_json  # noqa: E402

MODELS = {"gpt-1b": ("GPT", "1b"), "moe-1b": ("MoEGPT", "1b"), "gpt-tiny": ("GPT", "tiny")}


def measure(model_name: str, codegen: str | None, batch: int, seq: int, iters: int, regions: str = "layer") -> dict:
    """In this process: shard the model, time shard() and `iters` graphed steps. `regions`: "layer"
    (codegen's default: a region per layer's forward and backward) or "communication" (regions end
    only at fixed nodes: on one device, the whole forward and backward in one region)."""
    import fxshard
    from fxshard import models

    kind, preset = MODELS[model_name]
    cfg = getattr(models, f"{kind}Config").preset(preset)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = getattr(models, kind)(cfg)
    generator = torch.Generator().manual_seed(0)
    data = {key: torch.randint(0, cfg.vocab_size, (batch, seq), generator=generator).cuda() for key in ("idx", "tgt")}
    config = fxshard.Config(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cuda_graphs=True,
                            codegen=codegen, codegen_regions=regions if regions != "-" else "layer", verbose=True)
    started = time.perf_counter()
    step = fxshard.shard(model, lambda m, b: m.loss(b), data, optimizer=fxshard.optim.AdamW(lr=1e-4), config=config)
    shard_s = time.perf_counter() - started
    del model
    for _ in range(4):  # warm-up, then capture
        step(data)
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(iters):
        step(data)
    torch.cuda.synchronize()
    return {"model": model_name, "codegen": codegen, "regions": regions, "shard_s": shard_s,
            "ms_per_step": (time.perf_counter() - started) / iters * 1e3,
            "codegen_line": step.codegen.line() if step.codegen else None}


def in_subprocess(model_name, codegen, batch, seq, iters, cache_dir, regions="layer") -> dict:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache_dir)
    script = (f"import json, sys; sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r}); "
              f"from codegen import measure; "
              f"print('RESULT ' + json.dumps(measure({model_name!r}, {codegen!r}, {batch}, {seq}, {iters}, {regions!r})))")
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    sys.stderr.write(done.stderr[-3000:])
    line = next((l for l in done.stdout.splitlines() if l.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"{model_name} codegen={codegen} failed: {done.stderr[-2000:]}")
    return json.loads(line[len("RESULT "):])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["gpt-1b", "moe-1b"], choices=sorted(MODELS))
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--regions", nargs="+", default=["layer"], choices=["layer", "communication"],
                        help="how codegen cuts regions: per layer (default) or only at communication")
    parser.add_argument("--out", default="bench/codegen.json")
    args = parser.parse_args()
    rows = []
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, batch {args.batch} x {args.seq}", flush=True)
    print(f"{'model':<10} {'regions':<13} {'run':<12} {'shard s':>8} {'ms/step':>8}  codegen", flush=True)
    for model_name in args.models:
        runs = [(regions, run, "inductor") for regions in args.regions for run in ("cold", "warm")]
        for regions, run, codegen in runs + [("-", "no codegen", None)]:
            if run == "cold":
                cache_dir = tempfile.mkdtemp(prefix="inductor-cache-")
            try:
                row = in_subprocess(model_name, codegen, args.batch, args.seq, args.iters, cache_dir, regions)
            except RuntimeError as error:
                print(f"{model_name:<10} {regions:<13} {run:<12} failed: {str(error)[:400]}", flush=True)
                continue
            row["run"] = run
            rows.append(row)
            print(f"{model_name:<10} {regions:<13} {run:<12} {row['shard_s']:>8.1f} {row['ms_per_step']:>8.1f}  "
                  f"{row['codegen_line'] or '-'}", flush=True)
    write_json(args.out, batch=args.batch, seq=args.seq, rows=rows)


if __name__ == "__main__":
    main()
