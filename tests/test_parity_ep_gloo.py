"""Expert parallelism on real processes (gloo): every mesh and FSDP strategy trains like one device."""

import pytest
import torch
import torch.distributed as dist

import fxshard
from fxshard.launch import run_local
from fxshard.models import MoEGPT, MoEGPTConfig
from fxshard.passes.fsdp import STRATEGIES
from fxshard.testing import relative, torch_optimizer
from strategies import local_part, token_batches

ADAMW = fxshard.optim.AdamW(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
STEPS, LOCAL_BATCH, SEQ = 10, 2, 16  # local_part takes LOCAL_BATCH rows


def model(capacity):
    torch.manual_seed(0)
    return MoEGPT(MoEGPTConfig.preset("tiny", capacity_factor=capacity))  # 4 experts, top-2


def train_every_strategy(ep, capacity, batches, strategies=STRATEGIES):
    """On each rank: per strategy (ep_overlap on for every other one), losses, drops and final parameters."""
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {}
    for index, strategy in enumerate(strategies):
        config = fxshard.Config(sharding=strategy, ep_overlap=index % 2 == 1, ep_chunks=2)
        step = fxshard.shard(model(capacity), lambda m, b: m.loss_and_metrics(b), local_part(batches[0], rank),
                             optimizer=ADAMW, mesh=fxshard.Mesh(dp=world, ep=ep), config=config)
        metrics = [step(local_part(batch, rank)) for batch in batches]
        results[strategy] = ([m["loss"].item() for m in metrics], [m["moe_dropped_tokens"].item() for m in metrics],
                             step.parameters())
    return results


def eager_reference(capacity, batches, world):
    """One device; the loss is the mean of the ranks' local losses (routing, capacity and the balance
    loss per local batch, as data parallelism computes them)."""
    reference = model(capacity)
    optimizer = torch_optimizer(ADAMW, reference.parameters())
    losses, drops = [], []
    for batch in batches:
        optimizer.zero_grad()
        parts = [reference.loss_and_metrics(local_part(batch, rank)) for rank in range(world)]
        loss = sum(loss for loss, _ in parts) / world
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        drops.append(sum(m["moe_dropped_tokens"].item() for _, m in parts))
    return losses, drops, dict(reference.named_parameters())


# ep=4 on four ranks leaves each expert on one rank of its edp group (edp=1), where the strategies shard
# nothing of the experts; the rest shards over dp=4 as tests/test_parity_fsdp_gloo.py checks: two suffice.
# ep=2 on four ranks (edp=2) shards the experts: the optimizer state alone (ZeRO-1) and everything
# (ZeRO-3) on real processes; ZeRO-2 lies between them, and the SPMD simulator's property tests draw
# every strategy over these meshes and more (tests/passes/test_ep.py)
@pytest.mark.parametrize("world,ep,capacity,strategies", [(2, 2, None, STRATEGIES),
                                                          (4, 2, 1.0, ("optim", "optim_grads_params")),
                                                          (4, 4, None, ("no_shard", "optim_grads_params"))],
                         ids=["dp2-ep2", "dp4-ep2-capacity1", "dp4-ep4"])
def test_expert_parallel_matches_single_device_eager(world, ep, capacity, strategies):
    batches = token_batches(world, STEPS, LOCAL_BATCH, SEQ)
    per_rank = run_local(train_every_strategy, world, ep, capacity, batches, strategies, backend="gloo")
    ref_losses, ref_drops, ref_params = eager_reference(capacity, batches, world)
    for strategy in strategies:
        for rank in range(world):
            losses, drops, params = per_rank[rank][strategy]
            for step, (ours, eager) in enumerate(zip(losses, ref_losses)):
                assert abs(ours - eager) / abs(eager) < 1e-5, (strategy, rank, step, ours, eager)
            assert drops == ref_drops, (strategy, drops, ref_drops)
            worst = max(relative(params[name], p) for name, p in ref_params.items())
            assert worst < 1e-4, (strategy, rank, worst)
    if capacity is not None:
        assert sum(ref_drops) > 0  # the capacity bites: drops are part of what matched


# A transformers Qwen3-MoE with attention masks under dp=2 x ep=2 (ZeRO-3, overlap): the model matrix,
# tests/test_parity_models_gloo.py
