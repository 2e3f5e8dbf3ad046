"""Probe: does a FSDP (ZeRO-3) step over NCCL capture and replay in one CUDA graph?

    python bench/probes/cuda_graph_mesh.py MODE      # MODE: global | thread_local | relaxed

Two local ranks, GPT tiny; eager steps first, then capture, then replays compared with an eager twin.
Run each mode under `timeout`: a hang is one of the possible answers.
"""

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import fxshard  # noqa: E402
from fxshard.launch import run_local  # noqa: E402
from fxshard.models import GPT, GPTConfig  # noqa: E402
from fxshard.runtime.step import CudaGraphReplay  # noqa: E402


def probe(mode):
    rank = dist.get_rank()
    device = f"cuda:{rank}"
    generator = torch.Generator().manual_seed(rank)
    batches = [{"idx": torch.randint(0, 64, (2, 32), generator=generator).to(device),
                "tgt": torch.randint(0, 64, (2, 32), generator=generator).to(device)} for _ in range(6)]
    steps = []
    for graphed in (False, True):
        torch.manual_seed(0)
        model = GPT(GPTConfig.preset("tiny")).to(device)
        step = fxshard.shard(model, lambda m, b: m.loss(b), batches[0], mesh=fxshard.Mesh(dp=dist.get_world_size()))
        if graphed:
            step._replay = CudaGraphReplay(mode)
        steps.append(step)
    losses = [[s(b)["loss"].item() for b in batches] for s in steps]
    print(f"rank {rank} mode {mode}: captured={steps[1]._replay.is_captured} eager {losses[0]} graphed {losses[1]}",
          flush=True)
    return losses


if __name__ == "__main__":
    results = run_local(probe, 2, sys.argv[1], backend="nccl")
    same = all(r[0] == r[1] for r in results)
    print(f"{sys.argv[1]}: replay {'matches eager bit for bit' if same else 'DIFFERS from eager'}", flush=True)
