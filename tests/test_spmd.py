"""The SPMD simulator combines ranks' tensors exactly as gloo's functional collectives do."""

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx
import torch.multiprocessing as mp

from fxshard import FxShardError
from fxshard.spmd import simulate

c10d = torch.ops._c10d_functional

# name -> (function building the collective node from (graph, x, world, group), per-rank input shape)
CASES = {
    "all_gather": (lambda g, x, w, grp: g.call_function(c10d.all_gather_into_tensor.default, (x, w, grp)), (3, 2)),
    "reduce_scatter_sum": (lambda g, x, w, grp: g.call_function(
        c10d.reduce_scatter_tensor.default, (x, "sum", w, grp)), (4, 3)),
    "reduce_scatter_avg": (lambda g, x, w, grp: g.call_function(
        c10d.reduce_scatter_tensor.default, (x, "avg", w, grp)), (4, 3)),
    "all_reduce": (lambda g, x, w, grp: g.call_function(c10d.all_reduce.default, (x, "sum", grp)), (5,)),
    "all_to_all_even": (lambda g, x, w, grp: g.call_function(
        c10d.all_to_all_single.default, (x, [2] * w, [2] * w, grp)), (4, 2)),
}


def uneven_splits(rank, world):
    """Rank r sends r + 1 + d rows to rank d (so rank d receives sum_r (r + 1 + d) rows)."""
    send = [rank + 1 + dest for dest in range(world)]
    receive = [source + 1 + rank for source in range(world)]
    return send, receive


def build_graph(case: str, world: int, group: str, rank: int) -> fx.GraphModule:
    graph = fx.Graph()
    x = graph.placeholder("x")
    if case == "all_to_all_uneven":
        send, receive = uneven_splits(rank, world)
        collective = graph.call_function(c10d.all_to_all_single.default, (x, receive, send, group))
    else:
        collective = CASES[case][0](graph, x, world, group)
    waited = graph.call_function(c10d.wait_tensor.default, (collective,))
    graph.output(graph.call_function(torch.ops.aten.mul.Tensor, (waited, 2.0)))
    return fx.GraphModule(torch.nn.Module(), graph)


def rank_input(case: str, rank: int, world: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 + rank)
    if case == "all_to_all_uneven":
        rows = sum(uneven_splits(rank, world)[0])
        return torch.randn(rows, 3, generator=generator)
    return torch.randn(*CASES[case][1], generator=generator)


ALL_CASES = [*CASES, "all_to_all_uneven"]


def _gloo_worker(rank, world, init_file, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        group = dist.group.WORLD.group_name
        results = {case: build_graph(case, world, group, rank)(rank_input(case, rank, world)) for case in ALL_CASES}
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2])
def test_simulator_matches_gloo_for_each_collective(world):
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_gloo_worker, args=(world, os.path.join(tmp, "init"), tmp), nprocs=world,
                           start_method="spawn")
        real = [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(world)]
    for case in ALL_CASES:
        graphs = [build_graph(case, world, "world", r) for r in range(world)]
        simulated = simulate(graphs, [[rank_input(case, r, world)] for r in range(world)], {"world": range(world)})
        for rank in range(world):
            assert torch.allclose(simulated[rank], real[rank][case], rtol=1e-6, atol=1e-6), (case, rank)


@pytest.mark.parametrize("world", [1, 3, 4])
def test_simulated_collectives_follow_their_definitions(world):
    inputs = [rank_input("all_gather", r, world) for r in range(world)]
    graphs = [build_graph("all_gather", world, "g", r) for r in range(world)]
    for out in simulate(graphs, [[x] for x in inputs], {"g": range(world)}):
        assert torch.equal(out, 2 * torch.cat(inputs))
    inputs = [torch.randn(2 * world, 3) for _ in range(world)]
    graphs = [build_graph("reduce_scatter_sum", world, "g", r) for r in range(world)]
    outs = simulate(graphs, [[x] for x in inputs], {"g": range(world)})
    assert torch.allclose(torch.cat(outs), 2 * sum(inputs))
    inputs = [rank_input("all_to_all_uneven", r, world) for r in range(world)]
    graphs = [build_graph("all_to_all_uneven", world, "g", r) for r in range(world)]
    outs = simulate(graphs, [[x] for x in inputs], {"g": range(world)})
    for dest in range(world):
        expected = [inputs[src].split(uneven_splits(src, world)[0])[dest] for src in range(world)]
        assert torch.equal(outs[dest], 2 * torch.cat(expected))


def test_subgroups_run_independently_and_mismatches_are_reported():
    # ranks {0, 1} and {2, 3} all-reduce in their own groups
    graphs = [build_graph("all_reduce", 2, "a" if r < 2 else "b", r) for r in range(4)]
    inputs = [[torch.full((5,), float(r))] for r in range(4)]
    outs = simulate(graphs, inputs, {"a": [0, 1], "b": [2, 3]})
    assert [o[0].item() for o in outs] == [2.0, 2.0, 10.0, 10.0]
    with pytest.raises(FxShardError, match="deadlock"):
        simulate(graphs[:3], inputs[:3], {"a": [0, 1], "b": [2, 3]})
    mixed = [build_graph("all_reduce", 2, "a", 0), build_graph("all_gather", 2, "a", 1)]
    with pytest.raises(FxShardError, match="mismatched"):
        simulate(mixed, [[torch.zeros(5)], [torch.zeros(3, 2)]], {"a": [0, 1]})
    # the same collective with shapes a real group would refuse or hang on (a pass that shapes ranks apart)
    for case, shapes in (("all_gather", [(2,), (4,)]), ("all_reduce", [(5,), (3,)])):
        graphs = [build_graph(case, 2, "a", r) for r in range(2)]
        with pytest.raises(FxShardError, match="mismatched collectives on group 'a'"):
            simulate(graphs, [[torch.zeros(shape)] for shape in shapes], {"a": [0, 1]})
    graphs = [build_graph("all_to_all_uneven", 2, "a", r) for r in range(2)]
    inputs = [[rank_input("all_to_all_uneven", r, 2)] for r in range(2)]
    graphs[1].graph.find_nodes(op="call_function", target=c10d.all_to_all_single.default)[0].update_arg(1, [9, 9])
    graphs[1].recompile()  # rank 1 expects 9 rows from each peer, which sends it fewer
    with pytest.raises(FxShardError, match="mismatched collectives"):
        simulate(graphs, inputs, {"a": [0, 1]})


def test_a_view_runs_as_the_aten_replay_runs_it_where_the_real_layout_is_not_the_traced_one():
    """A traced view was chosen from fake strides; a kernel whose real output is laid out otherwise
    (Qwen3-Next's gated delta-net backward on CPU) makes it fail on the real tensor. CompiledStep's aten
    replay runs views as reshapes (graph.views_as_reshapes), and so does the simulator."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    graph.output(graph.call_function(torch.ops.aten.view.default, (x, [6])))
    transposed = torch.arange(6.0).reshape(2, 3).t()  # no view of it is flat
    (out,) = simulate([fx.GraphModule(torch.nn.Module(), graph)], [[transposed]], {})
    assert torch.equal(out, transposed.reshape(6))
