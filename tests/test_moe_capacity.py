"""fxshard.moe: dispatch with a capacity (deterministic drops) and combine, against a plain loop."""

import math

import torch
from hypothesis import given, strategies as st

import fxshard
from fxshard import moe
from fxshard.models import MoEGPT, MoEGPTConfig
from fxshard.passes.fsdp import FSDPConfig, fsdp
from fxshard.testing import SimulatedRanks, eager_parity


def loop_reference(chosen, n_experts, capacity_factor):
    """Assignments kept per expert, walking tokens in order and top-k slots in order."""
    tokens, k = chosen.shape
    capacity = math.inf if capacity_factor is None else max(1, math.ceil(capacity_factor * tokens * k / n_experts))
    kept, seen = [], [0] * n_experts
    for t in range(tokens):
        for slot in range(k):
            e = int(chosen[t, slot])
            if seen[e] < capacity:
                kept.append((e, t * k + slot))
            seen[e] += 1
    return sorted(kept)  # by expert, then by assignment order


@given(tokens=st.integers(1, 12), experts=st.integers(1, 5), data=st.data(),
       capacity_factor=st.sampled_from([None, 0.25, 0.5, 1.0, 1.5]))
def test_dispatch_keeps_the_first_assignments_per_expert_up_to_capacity(tokens, experts, data, capacity_factor):
    k = data.draw(st.integers(1, experts), label="k")
    generator = torch.Generator().manual_seed(data.draw(st.integers(0, 100), label="seed"))
    chosen = torch.stack([torch.randperm(experts, generator=generator)[:k] for _ in range(tokens)])
    x = torch.randn(tokens, 3, generator=generator)
    routed = moe.dispatch(x, chosen, experts, capacity_factor)
    expected = loop_reference(chosen, experts, capacity_factor)
    kept_rows = int(routed.offsets[-1])
    assert [int(a) for a in routed.order[:kept_rows]] == [a for _, a in expected]
    assert int(routed.dropped) == tokens * k - len(expected)
    assert routed.kept[:kept_rows].all() and not routed.kept[kept_rows:].any()
    assert torch.equal(routed.rows, x[routed.order // k])
    # combine: a token gets exactly its kept experts' outputs, weighted
    weights = torch.rand(tokens, k, generator=generator)
    expert_out = torch.randn(tokens * k, 3, generator=generator)
    out = moe.combine(expert_out, routed, weights, tokens)
    want = torch.zeros(tokens, 3)
    for row, assignment in enumerate(routed.order.tolist()):
        if row < kept_rows:
            want[assignment // k] += weights.reshape(-1)[assignment] * expert_out[row]
    torch.testing.assert_close(out, want)


def test_moe_gpt_with_a_capacity_trains_like_eager_and_reports_drops():
    torch.manual_seed(0)
    cfg = MoEGPTConfig.preset("tiny", capacity_factor=0.5)
    generator = torch.Generator().manual_seed(0)
    batches = [{"idx": torch.randint(0, 64, (4, 16), generator=generator),
                "tgt": torch.randint(0, 64, (4, 16), generator=generator)} for _ in range(6)]
    model = MoEGPT(cfg)
    parity = eager_parity(model, lambda m, b: m.loss(b), batches, fxshard.optim.AdamW(lr=1e-3))
    assert parity.max_loss_rel < 1e-5 and parity.max_param_rel < 1e-4
    step = fxshard.shard(model, lambda m, b: m.loss_and_metrics(b), batches[0], optimizer=fxshard.optim.AdamW())
    metrics = step(batches[0])
    assert metrics["moe_dropped_tokens"].item() == model.loss_and_metrics(batches[0])[1]["moe_dropped_tokens"].item()
    assert metrics["moe_dropped_tokens"].item() == 2 * (64 * 2 - 4 * 16)  # 2 layers, 4 experts x capacity 16


def test_balanced_routing_fills_every_expert_exactly_and_still_trains_the_router(monkeypatch):
    """MoEGPTConfig(routing="balanced"), for benchmarks: T*k/E rows per expert, nothing dropped at
    capacity 1.0, the router still learns (its probabilities weight the combine); fxshard == eager."""
    torch.manual_seed(0)
    cfg = MoEGPTConfig.preset("tiny", capacity_factor=1.0, routing="balanced")
    generator = torch.Generator().manual_seed(0)
    batches = [{"idx": torch.randint(0, 64, (2, 8), generator=generator),
                "tgt": torch.randint(0, 64, (2, 8), generator=generator)} for _ in range(4)]
    model = MoEGPT(cfg)
    layer = model.layers[0].moe
    chosen_per_layer = []
    original = moe.dispatch

    def recording_dispatch(tokens, chosen, *args, **kwargs):
        chosen_per_layer.append(chosen)
        return original(tokens, chosen, *args, **kwargs)

    monkeypatch.setattr(moe, "dispatch", recording_dispatch)
    _, metrics = model.loss_and_metrics(batches[0])
    monkeypatch.undo()
    assert len(chosen_per_layer) == cfg.n_layer
    counts = torch.bincount(chosen_per_layer[0].reshape(-1), minlength=cfg.n_expert)
    assert counts.tolist() == [16 * cfg.top_k // cfg.n_expert] * cfg.n_expert
    assert metrics["moe_dropped_tokens"].item() == 0
    model.loss(batches[0]).backward()
    assert layer.router.weight.grad.abs().sum() > 0
    parity = eager_parity(MoEGPT(cfg), lambda m, b: m.loss(b), batches, fxshard.optim.AdamW(lr=1e-3))
    assert parity.max_loss_rel < 1e-5


def test_fsdp_sums_reported_metrics_over_ranks():
    torch.manual_seed(0)
    model = MoEGPT(MoEGPTConfig.preset("tiny", capacity_factor=0.75))
    generator = torch.Generator().manual_seed(1)
    local = [{"idx": torch.randint(0, 64, (2, 8), generator=generator),
              "tgt": torch.randint(0, 64, (2, 8), generator=generator)} for _ in range(2)]
    program = fxshard.trace(model, lambda m, b: m.loss_and_metrics(b), local[0])
    ranks = SimulatedRanks(fsdp(program, FSDPConfig(2)), model, fxshard.optim.AdamW(), fxshard.Mesh(dp=2))
    metrics = ranks.step(local)
    expected = sum(model.loss_and_metrics(b)[1]["moe_dropped_tokens"].item() for b in local)
    assert expected > 0
    assert all(m["moe_dropped_tokens"].item() == expected for m in metrics)


@given(tokens=st.integers(1, 12), experts=st.integers(1, 5), data=st.data(),
       capacity_factor=st.sampled_from([0.25, 0.5, 1.0, 1.5]))
def test_slot_dispatch_and_combine_compute_what_the_packed_layout_does(tokens, experts, data, capacity_factor):
    """moe.dispatch(slots=True): each expert's kept rows first in its C-row slot, in the packed
    layout's order; a per-expert function of the rows, combined, gives the same token outputs and the
    same gradients for tokens, routing weights and the function's parameters."""
    k = data.draw(st.integers(1, experts), label="k")
    generator = torch.Generator().manual_seed(data.draw(st.integers(0, 100), label="seed"))
    chosen = torch.stack([torch.randperm(experts, generator=generator)[:k] for _ in range(tokens)])
    scale = torch.randn(experts, 3, generator=generator)  # expert e multiplies its rows by scale[e]
    results = []
    for slots in (False, True):
        x = torch.randn(tokens, 3, generator=torch.Generator().manual_seed(7)).requires_grad_()
        weights = torch.rand(tokens, k, generator=torch.Generator().manual_seed(8)).requires_grad_()
        params = scale.clone().requires_grad_()
        routed = moe.dispatch(x, chosen, experts, capacity_factor, slots=slots)
        owner = fxshard.ops.grouped_mlp_backends.expert_of_rows(
            routed.offsets, routed.rows.shape[0], routed.capacity if slots else None)
        padded = torch.cat([params, torch.zeros(1, 3)])  # rows no expert owns get 0 (as the GEMMs' masks)
        out = moe.combine(routed.rows * padded[owner], routed, weights, tokens)
        grads = torch.autograd.grad(out, (x, weights, params), torch.randn(tokens, 3, generator=torch.Generator()
                                                                           .manual_seed(9)))
        results.append((out, grads, routed))
    (packed_out, packed_grads, packed), (slot_out, slot_grads, slotted) = results
    capacity = slotted.capacity
    assert slotted.rows.shape[0] == experts * capacity and torch.equal(slotted.offsets, packed.offsets)
    assert int(slotted.dropped) == int(packed.dropped)
    start = 0
    for expert, end in enumerate(packed.offsets.tolist()):  # kept rows, same order, at the start of the slot
        rows = packed.rows[start:end]
        assert torch.equal(slotted.rows[expert * capacity:expert * capacity + len(rows)], rows)
        assert slotted.kept[expert * capacity:(expert + 1) * capacity].sum() == len(rows)
        start = end
    torch.testing.assert_close(slot_out, packed_out)
    for ours, want in zip(slot_grads, packed_grads):
        torch.testing.assert_close(ours, want)


def test_moe_gpt_with_expert_slots_trains_like_the_packed_layout_and_like_eager():
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    batches = [{"idx": torch.randint(0, 64, (4, 16), generator=generator),
                "tgt": torch.randint(0, 64, (4, 16), generator=generator)} for _ in range(6)]
    losses = {}
    for slots in (False, True):
        torch.manual_seed(0)
        model = MoEGPT(MoEGPTConfig.preset("tiny", capacity_factor=0.75, expert_slots=slots))
        parity = eager_parity(model, lambda m, b: m.loss(b), batches, fxshard.optim.AdamW(lr=1e-3))
        assert parity.max_loss_rel < 1e-5 and parity.max_param_rel < 1e-4
        losses[slots] = torch.stack([torch.as_tensor(loss) for loss in parity.losses])
    torch.testing.assert_close(losses[True], losses[False], rtol=1e-5, atol=1e-6)


def test_expert_slots_need_a_capacity_factor():
    import pytest

    model = MoEGPT(MoEGPTConfig.preset("tiny", expert_slots=True))
    batch = {"idx": torch.zeros(2, 8, dtype=torch.long), "tgt": torch.zeros(2, 8, dtype=torch.long)}
    with pytest.raises(fxshard.FxShardError, match="needs a capacity factor"):
        fxshard.trace(model, lambda m, b: m.loss(b), batch)


def test_gather_rows_reads_the_indexed_row_or_zero():
    from fxshard.ops import gather_rows

    src = torch.arange(12.0).reshape(4, 3)
    index = torch.tensor([3, 0, 0, 2, 1])
    keep = torch.tensor([True, False, True, True, False])
    want = torch.stack([src[3], torch.zeros(3), src[0], src[2], torch.zeros(3)])
    assert torch.equal(gather_rows(src, index, keep), want)
