"""Where `fxshard.shard` spends its time: GPT 1b on one GPU (bf16 compute, AdamW, CUDA graphs,
Inductor codegen), profiled with cProfile. Run it twice with the same TORCHINDUCTOR_CACHE_DIR: the
first run fills Inductor's cache (cold), the second is the warm compile issue 15 wants under 10 s.

    TORCHINDUCTOR_CACHE_DIR=/tmp/ind python bench/probes/shard_profile.py            # cold
    TORCHINDUCTOR_CACHE_DIR=/tmp/ind python bench/probes/shard_profile.py --top 40   # warm

Prints shard()'s wall time and the functions with the most cumulative and own time.
"""

import argparse
import cProfile
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import fxshard  # noqa: E402
from fxshard.models import GPT, GPTConfig  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="1b")
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    cfg = GPTConfig.preset(args.preset)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = GPT(cfg)
    data = {k: torch.randint(0, cfg.vocab_size, (1, 2048), device="cuda") for k in ("idx", "tgt")}
    config = fxshard.Config(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cuda_graphs=True)
    profile = cProfile.Profile()
    started = time.perf_counter()
    profile.enable()
    step = fxshard.shard(model, lambda m, b: m.loss(b), data, optimizer=fxshard.optim.AdamW(lr=1e-4), config=config)
    profile.disable()
    print(f"shard() {time.perf_counter() - started:.2f} s; {step.lowerings()}", flush=True)
    stats = pstats.Stats(profile)
    stats.sort_stats("cumulative").print_stats(args.top)
    stats.sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
