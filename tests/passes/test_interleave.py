"""The microbatch-interleaving pass: same values bit for bit, backward m alternating with forward m+1."""

import pytest
import torch
from hypothesis import given, strategies as st

import fxshard
from fxshard import meta
from fxshard.codegen import is_communication
from fxshard.models import MoEGPT, MoEGPTConfig
from fxshard.passes import run_pipeline
from fxshard.passes.fsdp import STRATEGIES
from fxshard.passes.interleave import interleave_microbatches
from fxshard.testing import assert_bit_identical, traced_once
from strategies import rank_batches

c10d = torch.ops._c10d_functional


@given(microbatches=st.sampled_from([2, 3, 4]), chunks=st.sampled_from([1, 2]), sharding=st.sampled_from(STRATEGIES),
       capacity=st.sampled_from([None, 1.0]), pairing=st.sampled_from(["combined-1f1b", "dual-batch"]))
def test_interleaving_changes_the_order_not_the_values(microbatches, chunks, sharding, capacity, pairing):
    torch.manual_seed(0)
    model = MoEGPT(MoEGPTConfig.preset("tiny", capacity_factor=capacity))
    sgd = fxshard.optim.SGD(lr=0.5, momentum=0.9)
    mesh = fxshard.Mesh(dp=2, ep=2)
    local = rank_batches(2, rows=12 if microbatches == 3 else 4)
    config = fxshard.Config(microbatches=microbatches, ep_overlap=True, ep_chunks=chunks, sharding=sharding,
                            ep_interleave=pairing)
    traced = traced_once(("interleave", capacity, microbatches), lambda: fxshard.trace(  # the rest: passes only
        model, lambda m, b: m.loss_and_metrics(b), local[0], optimizer=sgd, config=config))
    programs = run_pipeline(traced, mesh, config)
    assert [p.name for p in programs][-3:] == ["fsdp", "overlap", "interleave"]
    before, after = programs[-2], programs[-1]
    assert sorted(n.name for n in before.graph.nodes) == sorted(n.name for n in after.graph.nodes)
    assert_bit_identical([before, after], model, sgd, mesh, local)


def before_interleaving():
    """MoEGPT tiny, 2 microbatches, (dp=2, ep=2): the program the interleaving pass receives."""
    torch.manual_seed(0)
    model = MoEGPT(MoEGPTConfig.preset("tiny"))
    config = fxshard.Config(microbatches=2, ep_overlap=True, ep_chunks=1, sharding="no_shard")
    batch = rank_batches(1, 4)[0]
    program = run_pipeline(fxshard.trace(model, lambda m, b: m.loss_and_metrics(b), batch, config=config),
                           fxshard.Mesh(dp=2, ep=2), config)[-2]
    return model, program


def test_backward_and_next_forward_alternate_at_each_all_to_all():
    _, program = before_interleaving()
    assert switches(interleave_microbatches(program)) >= 4 > switches(program)  # both layers, both directions


def test_dual_batch_alternates_the_two_forwards_and_the_two_backwards():
    model, program = before_interleaving()
    after = interleave_microbatches(program, "dual-batch")
    pairs = [(("fwd", 0), ("fwd", 1)), (("bwd", 0), ("bwd", 1))]
    layers = model.cfg.n_layer
    # each microbatch's dispatch and combine, both layers, both phases: the other one computes next
    assert switches(after, pairs) >= 2 * 2 * 2 * layers - 2 > switches(program, pairs)
    with pytest.raises(fxshard.FxShardError, match="ep_interleave"):
        fxshard.Config(ep_interleave="zigzag")


def switches(program, pairs=((("bwd", 0), ("fwd", 1)),)) -> int:
    """How many dispatch / combine all-to-alls of either side of a pair (default: backward 0 and
    forward 1) are followed by compute of the other side."""
    nodes = list(program.graph.nodes)
    count = 0
    for i, node in enumerate(nodes):
        if node.target is not c10d.all_to_all_single.default or node.meta[meta.MOE_PIECE] == "route":
            continue
        kind = (meta.phase(node), meta.microbatch(node))
        for pair in pairs:
            if kind in pair:
                other = pair[1 - pair.index(kind)]
                following = next((n for n in nodes[i + 1:] if n.op == "call_function" and meta.MOE_PIECE not in n.meta
                                  and (meta.phase(n), meta.microbatch(n)) in pair), None)
                count += following is not None and (meta.phase(following), meta.microbatch(following)) == other
    return count


@pytest.mark.parametrize("sharding, microbatches", [("no_shard", 2), ("optim_grads_params", 3)])
def test_a_units_flat_gradient_stays_next_to_the_accumulation_it_reads(sharding, microbatches):
    """The fsdp pass builds a unit's flat gradient (a cat of its accumulated gradients) without a
    microbatch of its own; interleaving keeps it with the last microbatch's accumulation it reads, so
    no communication separates them and codegen fuses the add into the flat buffer's write."""
    torch.manual_seed(0)
    model = MoEGPT(MoEGPTConfig.preset("tiny"))
    config = fxshard.Config(microbatches=microbatches, ep_overlap=True, ep_chunks=1, sharding=sharding,
                            ep_interleave="dual-batch")
    batch = rank_batches(1, 12 if microbatches == 3 else 4)[0]
    program = run_pipeline(fxshard.trace(model, lambda m, b: m.loss_and_metrics(b), batch, config=config),
                           fxshard.Mesh(dp=2, ep=2), config)[-1]
    nodes = list(program.graph.nodes)
    position = {node: i for i, node in enumerate(nodes)}
    flats = [n for n in nodes if n.target is torch.ops.aten.cat.default and meta.phase(n) == meta.BWD
             and meta.MICROBATCH not in n.meta
             and any(i.target is torch.ops.aten.view.default for i in n.all_input_nodes)]
    assert flats
    for flat in flats:
        read = max((position[i.args[0]] if i.target is torch.ops.aten.view.default else position[i])
                   for i in flat.all_input_nodes)
        between = [n.name for n in nodes[read:position[flat]] if is_communication(n)]
        assert not between, f"{flat.name} waits behind {between}"
    # ZeRO-3's all-gathers carry their microbatch: each stays ahead of its use with compute in between
    # (counted as microbatch 0's, a later microbatch's gathers were pulled next to their waits)
    gathers = [n for n in nodes if n.target is c10d.all_gather_into_tensor.default and meta.phase(n) != meta.OPTIM]
    assert bool(gathers) == (sharding == "optim_grads_params")
    for gather in gathers:
        (wait,) = gather.users
        assert any(n.op == "call_function" and not is_communication(n) and n.target is not c10d.wait_tensor.default
                   for n in nodes[position[gather] + 1:position[wait]]), (gather.name, meta.microbatch(gather))


def test_dual_batch_does_not_switch_at_the_count_exchange():
    """With balanced routing the count exchange reads nothing of its layer's forward: issued right
    after the previous combine wait, a switch there would leave the other microbatch's combine with
    nothing to hide behind. In each layer's forward, microbatch 0's dispatch hides microbatch 1's
    attention, and microbatch 1's combine hides microbatch 0's attention of the next layer."""
    torch.manual_seed(0)
    model = MoEGPT(MoEGPTConfig.preset("tiny", routing="balanced"))
    config = fxshard.Config(microbatches=2, ep_overlap=True, ep_chunks=1, sharding="no_shard",
                            ep_interleave="dual-batch")
    programs = run_pipeline(fxshard.trace(model, lambda m, b: m.loss_and_metrics(b), rank_batches(1, 4)[0],
                                          config=config), fxshard.Mesh(dp=2, ep=2), config)
    nodes = list(programs[-1].graph.nodes)
    position = {node: i for i, node in enumerate(nodes)}
    hiding = []
    for node in nodes:
        if (node.target is c10d.all_to_all_single.default and meta.phase(node) == meta.FWD
                and node.meta[meta.MOE_PIECE] != "route"):
            wait = next(user for user in node.users if user.target is c10d.wait_tensor.default)
            other = 1 - meta.microbatch(node)
            if any("scaled_dot_product" in str(n.target) and meta.microbatch(n) == other
                   for n in nodes[position[node] + 1:position[wait]]):
                hiding.append((meta.layer(node), meta.microbatch(node), node.meta[meta.MOE_PIECE]))
    layers = [f"layers.{i}" for i in range(model.cfg.n_layer)]
    assert sorted(hiding) == sorted([(layer, 0, "dispatch") for layer in layers] +
                                    [(layer, 1, "combine") for layer in layers[:-1]])


@pytest.mark.parametrize("sharding", ["no_shard", "optim"])
def test_dual_batch_microbatches_take_turns_at_every_all_to_all(sharding):
    """Dispatches and combines are issued by the two microbatches in turn, in both phases: the
    gradient reductions the last microbatch issues (all-reduces, reduce-scatters over dp) are no
    switch points, so it is not sent away before its own next dispatch."""
    torch.manual_seed(0)
    model = MoEGPT(MoEGPTConfig.preset("tiny"))
    config = fxshard.Config(microbatches=2, ep_overlap=True, ep_chunks=1, sharding=sharding, ep_interleave="dual-batch")
    programs = run_pipeline(fxshard.trace(model, lambda m, b: m.loss_and_metrics(b), rank_batches(1, 4)[0],
                                          optimizer=fxshard.optim.AdamW(lr=1e-3), config=config),
                            fxshard.Mesh(dp=2, ep=2), config)
    for phase in (meta.FWD, meta.BWD):
        issuers = [meta.microbatch(n) for n in programs[-1].graph.nodes
                   if n.target is c10d.all_to_all_single.default and meta.phase(n) == phase
                   and n.meta[meta.MOE_PIECE] != "route"]
        assert issuers == [0, 1] * (len(issuers) // 2) and len(issuers) == 2 * 2 * model.cfg.n_layer, (phase, issuers)
