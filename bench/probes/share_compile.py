"""Config(share_compile) on one host: how long shard() takes each rank of a ZeRO-3 job under codegen,
with the ranks splitting the compiling and with each compiling everything, each from an empty Inductor
cache. Prints one line per rank and setting, and writes JSON.

    python bench/probes/share_compile.py --gpus 2 --model 1b --json out.json
"""

import argparse
import json
import os
import tempfile
import time

import torch
import torch.distributed as dist

import fxshard
from fxshard.launch import run_local
from fxshard.models import GPT, GPTConfig


def job(preset: str, share: bool, cache: str, rows: int, seq: int):
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache  # before Inductor reads it (first compile)
    os.environ["TRITON_CACHE_DIR"] = os.path.join(cache, "triton")
    rank = dist.get_rank()
    device = torch.device("cuda", rank) if torch.cuda.is_available() else torch.device("cpu")
    cfg = GPTConfig.preset(preset)
    with torch.device("meta"):
        model = GPT(cfg)
    batch = {"idx": torch.randint(0, cfg.vocab_size, (rows, seq), device=device),
             "tgt": torch.randint(0, cfg.vocab_size, (rows, seq), device=device)}
    config = fxshard.Config(sharding="optim_grads_params", codegen="inductor", share_compile=share,
                            param_dtype=torch.bfloat16 if device.type == "cuda" else None)
    started = time.perf_counter()
    step = fxshard.shard(model, lambda m, b: m.loss(b), batch, mesh=fxshard.Mesh(dp=dist.get_world_size()),
                         config=config)
    seconds = time.perf_counter() - started
    loss = step(batch)["loss"].item()
    return {"rank": rank, "share_compile": share, "shard_s": round(seconds, 2), "codegen_s": round(step.codegen.seconds, 2),
            "line": step.codegen.line(), "loss": loss}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--model", default="1b")
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=2, help="pairs of runs (each setting once a pair)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    results = []
    for share in (False, True) * args.repeats:
        cache = tempfile.mkdtemp(prefix="inductor_")
        rows = run_local(job, args.gpus, args.model, share, cache, args.rows, args.seq, backend=backend)
        for row in rows:
            print(f"share_compile={row['share_compile']!s:5} rank {row['rank']}: shard {row['shard_s']:6.1f} s, "
                  f"codegen {row['codegen_s']:6.1f} s, loss {row['loss']:.4f} | {row['line']}", flush=True)
        results.extend(rows)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"args": vars(args), "results": results}, handle, indent=1)


if __name__ == "__main__":
    main()
