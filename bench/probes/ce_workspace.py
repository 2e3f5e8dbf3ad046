"""How much symmetric memory the copy-engine collectives of a real program need, with and without
region reuse (fxshard/runtime/workspace_plan.py), counted on CPU without running a step.

    python bench/probes/ce_workspace.py

Builds rank 0's program of a 2-rank mesh (meta-device model, torch's FakeProcessGroup) for bench/fsdp.py's
GPT 1b under ZeRO-3 at batch 4 x 2048, and for bench/moe.py's MoE (ZeRO-1, dp = ep = 2, 2 microbatches,
dual-batch overlap), lowers every collective it can to the copy engines as CompiledStep would on CUDA,
and prints the lowering's report line (collectives lowered, workspace per group against no reuse).
"""

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import fxshard  # noqa: E402
from fxshard.models import GPT, GPTConfig, MoEGPT, MoEGPTConfig  # noqa: E402
from fxshard.passes import run_pipeline  # noqa: E402
from fxshard.runtime.copy_engine import lower_to_copy_engines  # noqa: E402
from fxshard.runtime.reinplace import reinplace  # noqa: E402


def report(name, model, loss_fn, batch, config, mesh):
    traced = fxshard.trace(model, loss_fn, batch, optimizer=fxshard.optim.AdamW(lr=1e-4), config=config)
    program = run_pipeline(traced, mesh, config)[-1]
    _, lowering = lower_to_copy_engines(reinplace(program.graph_module)[0], all_to_alls=True, gathers_and_scatters=True)
    print(f"{name}: {lowering.line()}", flush=True)


def main():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    with torch.device("meta"):
        gpt = GPT(GPTConfig.preset("1b"))
    report("GPT 1b ZeRO-3, batch 4 x 2048", gpt, lambda m, b: m.loss(b),
           {k: torch.zeros(4, 2048, dtype=torch.long) for k in ("idx", "tgt")},
           fxshard.Config(param_dtype=torch.bfloat16, reduce_dtype=torch.float32), fxshard.Mesh(dp=2))
    cfg = MoEGPTConfig(vocab_size=32000, d_model=2048, n_layer=4, n_head=16, n_expert=64, top_k=8, d_ff_expert=1024,
                       d_ff_shared=None, capacity_factor=1.0, routing="balanced")
    with torch.device("meta"):
        moe = MoEGPT(cfg)
    report("bench/moe.py MoE, ZeRO-1, dp = ep = 2, dual-batch", moe, lambda m, b: m.loss_and_metrics(b),
           {k: torch.zeros(2, 4096, dtype=torch.long) for k in ("idx", "tgt")},
           fxshard.Config(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, sharding="optim", ep_overlap=True,
                          microbatches=2, ep_interleave="dual-batch"), fxshard.Mesh(dp=2, ep=2))


if __name__ == "__main__":
    main()
