"""The all-to-all window pass: same values bit for bit, independent work moved between issue and wait."""

import torch
from hypothesis import given, strategies as st

import fxshard
from fxshard import dump, meta
from fxshard.codegen import find_regions
from fxshard.models import MoEGPT, MoEGPTConfig
from fxshard.passes import run_pipeline
from fxshard.passes.fsdp import STRATEGIES
from fxshard.passes.overlap import fill_ep_windows
from fxshard.testing import assert_bit_identical
from strategies import rank_batches

c10d = torch.ops._c10d_functional
GEMMS = {torch.ops.aten.mm.default, torch.ops.fxshard.grouped_mlp_wgrad.default,
         torch.ops.fxshard.grouped_mm_wgrad.default}


def compile_programs(model, mesh, config, batch, optimizer=None):
    traced = fxshard.trace(model, lambda m, b: m.loss_and_metrics(b), batch, optimizer=optimizer, config=config)
    return run_pipeline(traced, mesh, config)


@given(mesh=st.sampled_from([(2, 2), (4, 2)]), chunks=st.sampled_from([1, 2]), sharding=st.sampled_from(STRATEGIES),
       shared=st.booleans(), fused=st.booleans(), microbatches=st.sampled_from([1, 2]),
       capacity=st.sampled_from([None, 1.0]))
def test_filling_windows_changes_the_order_not_the_values(mesh, chunks, sharding, shared, fused, microbatches,
                                                           capacity):
    world, ep = mesh
    torch.manual_seed(0)
    model = MoEGPT(MoEGPTConfig.preset("tiny", capacity_factor=capacity, d_ff_shared=32 if shared else None))
    sgd = fxshard.optim.SGD(lr=0.5, momentum=0.9)
    mesh = fxshard.Mesh(dp=world, ep=ep)
    local = rank_batches(world, 2)
    config = fxshard.Config(microbatches=microbatches, ep_overlap=True, ep_chunks=chunks, sharding=sharding,
                            fuse_grouped_mlp=fused)
    programs = {p.name: p for p in compile_programs(model, mesh, config, local[0], sgd)}
    before, after = programs["fsdp"], programs["overlap"]
    assert sorted(n.name for n in before.graph.nodes) == sorted(n.name for n in after.graph.nodes)
    assert_bit_identical([before, after], model, sgd, mesh, local)
    # FSDP's decisions stand: no all-gather is issued later, no other collective's wait is earlier
    old_before, new_before = preceding(before), preceding(after)
    for node in before.graph.nodes:
        if node.target is c10d.all_gather_into_tensor.default:
            assert new_before[node.name] <= old_before[node.name], node.name
        if node.target is c10d.wait_tensor.default and meta.MOE_PIECE not in node.args[0].meta:
            assert old_before[node.name] <= new_before[node.name], node.name


def preceding(program) -> dict[str, set[str]]:
    """For every node, the names of the compute nodes ordered before it."""
    seen, result = set(), {}
    for node in program.graph.nodes:
        result[node.name] = set(seen)
        if node.op == "call_function":
            seen.add(node.name)
    return result


def windows(program) -> list[tuple[str, str, int]]:
    """(phase, piece, GEMMs between issue and wait) for every dispatch / combine all-to-all."""
    nodes = list(program.graph.nodes)
    result = []
    for i, node in enumerate(nodes):
        if node.target is c10d.all_to_all_single.default and node.meta.get(meta.MOE_PIECE) in ("dispatch", "combine"):
            (wait,) = [u for u in node.users if u.target is c10d.wait_tensor.default]
            inside = nodes[i + 1:nodes.index(wait)]
            result.append((meta.phase(node), node.meta[meta.MOE_PIECE], sum(n.target in GEMMS for n in inside)))
    return result


def test_weight_gradients_and_the_shared_expert_fill_the_windows():
    torch.manual_seed(0)
    model = MoEGPT(MoEGPTConfig.preset("tiny", d_ff_shared=32))
    config = fxshard.Config(ep_overlap=True, ep_chunks=1, sharding="optim_grads_params")
    programs = {p.name: p for p in compile_programs(model, fxshard.Mesh(dp=2, ep=2), config, rank_batches(1, 2)[0])}
    before, after = windows(programs["fsdp"]), windows(programs["overlap"])
    layers = model.cfg.n_layer
    # backward dispatch: the traced order leaves it nothing; afterwards the weight gradients of the
    # layer above (or the head) and the shared expert's backward run while it travels
    assert [n for phase, piece, n in before if (phase, piece) == ("bwd", "dispatch")] == [0] * layers
    assert all(n >= 6 for phase, piece, n in after if (phase, piece) == ("bwd", "dispatch"))
    # forward combine: the shared expert (three matmuls) moves from after the wait to inside
    assert [n for phase, piece, n in before if (phase, piece) == ("fwd", "combine")] == [0] * layers
    assert [n for phase, piece, n in after if (phase, piece) == ("fwd", "combine")] == [3] * layers
    # backward combine: already the experts' weight gradient; the router's backward joins it
    for (phase, piece, n_before), (_, _, n_after) in zip(before, after):
        assert n_after >= n_before
    summary = dump.summarize(programs["overlap"])
    assert "expert-parallel all-to-all windows" in summary
    # only work worth a window moves: elementwise work stays next to what codegen fuses it with, so
    # codegen's regions write out about what they did before (the weight gradients moved into the
    # windows are new region outputs; moving everything independent wrote out 15% more bytes here)
    assert region_output_bytes(programs["overlap"]) <= 1.05 * region_output_bytes(programs["fsdp"])


def region_output_bytes(program) -> int:
    """The bytes of the values codegen's regions write for later regions and fixed nodes to read."""
    return sum(node.meta["val"].numel() * node.meta["val"].element_size() for region in find_regions(program.graph)
               for node in region.outputs if isinstance(node.meta.get("val"), torch.Tensor))


def test_without_ep_all_to_alls_nothing_moves():
    torch.manual_seed(0)
    model = MoEGPT(MoEGPTConfig.preset("tiny"))
    config = fxshard.Config(sharding="optim_grads_params")
    (fsdp_program,) = [p for p in compile_programs(model, fxshard.Mesh(dp=2), config, rank_batches(1, 2)[0])
                       if p.name == "fsdp"]
    after = fill_ep_windows(fsdp_program)
    assert [n.name for n in after.graph.nodes] == [n.name for n in fsdp_program.graph.nodes]
