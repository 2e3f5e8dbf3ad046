"""AdamW's `grad_scale`: clipping's coefficient and a loss scale's inverse are applied by
`fxshard::adamw_update` as it loads each gradient, instead of a multiply that writes a scaled copy
first (fxshard/optimizer_graph.py, `_Phase.arguments`). The step computes the same bits either way."""

import copy

import pytest
import torch
from hypothesis import given, settings, strategies as st

import fxshard
from fxshard.optim import AdamW
from fxshard.passes.fsdp import FSDPConfig, fsdp
from fxshard.testing import SimulatedRanks
from test_nonfinite import Regressor, regression_batches, regression_loss

ADAMW = fxshard.optim.AdamW(lr=1e-2, weight_decay=0.1, no_decay=("*.bias",))
ADAMW_OP = torch.ops.fxshard.adamw_update.default


def run(model, batches, config, sharded):
    """Losses, parameters and the traced program of three steps, on one device or ZeRO-3 over two
    simulated ranks."""
    program = fxshard.trace(model, regression_loss, batches[0] if not sharded else halves(batches[0])[0],
                            optimizer=ADAMW, config=config)
    if sharded:
        program = fsdp(program, FSDPConfig(2, "optim_grads_params"))
    ranks = SimulatedRanks(program, model, ADAMW, fxshard.Mesh(dp=2 if sharded else 1))
    losses = [ranks.step(halves(batch) if sharded else [batch])[0]["loss"] for batch in batches]
    return losses, ranks.parameters(0), program


def halves(batch):
    return [{k: v[:2] for k, v in batch.items()}, {k: v[2:] for k, v in batch.items()}]


@settings(max_examples=max(3, settings.default.max_examples // 2), deadline=None)  # ~1 s an example
@given(clip=st.sampled_from([None, 0.05]), scale=st.sampled_from([None, 2.0 ** 12, 1000.0, "dynamic"]),
       sharded=st.booleans(), seed=st.integers(0, 3))
def test_adamw_applying_the_multiplier_changes_no_bit(clip, scale, sharded, seed):
    """Against the same program with the multiply done before AdamW (AdamW.takes_grad_scale off):
    losses and parameters equal bit for bit, with clipping, a static or dynamic loss scale, under
    ZeRO-3 too; where something multiplies, every AdamW update takes it as its grad_scale."""
    torch.manual_seed(seed)
    model = Regressor()
    batches = regression_batches(3, rows=4, seed=seed)
    config = fxshard.Config(clip_grad_norm=clip, loss_scale=scale)
    fused = run(copy.deepcopy(model), batches, config, sharded)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(AdamW, "takes_grad_scale", lambda self, param: False)
        multiplied = run(copy.deepcopy(model), batches, config, sharded)
    for ours, theirs in zip(fused[0], multiplied[0]):
        assert torch.equal(ours, theirs)
    for name, value in multiplied[1].items():
        assert torch.equal(fused[1][name], value), name
    updates = [n for n in fused[2].graph.nodes if n.target is ADAMW_OP]
    scaled = clip is not None or scale is not None
    assert updates and all((len(n.args) == 12) == scaled for n in updates)
    assert not any(len(n.args) == 12 for n in multiplied[2].graph.nodes if n.target is ADAMW_OP)


def test_sgd_still_takes_the_multiplied_gradient():
    """SGD applies no grad_scale: the phase multiplies before it, and the step matches torch's
    clip_grad_norm_ + SGD."""
    torch.manual_seed(0)
    model = Regressor()
    batches = regression_batches(2, rows=4)
    sgd = fxshard.optim.SGD(lr=0.1, momentum=0.9)
    step = fxshard.shard(copy.deepcopy(model), regression_loss, batches[0], optimizer=sgd,
                         config=fxshard.Config(clip_grad_norm=0.05))
    reference = copy.deepcopy(model)
    torch_sgd = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for batch in batches:
        step(batch)
        torch_sgd.zero_grad()
        regression_loss(reference, batch).backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
        torch_sgd.step()
    for (name, ours), theirs in zip(step.parameters().items(), reference.parameters()):
        assert torch.allclose(ours, theirs, rtol=1e-5, atol=1e-7), name
