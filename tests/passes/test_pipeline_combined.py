"""Combined 1F1B inside pipelines: a stage's forward of microbatch m+w and backward of microbatch m
interleave at the MoE all-to-alls (fxshard.schedule.combine_pairs, passes/interleave.interleave_actions)."""

import functools

import pytest
import torch
from hypothesis import given, settings, strategies as st

import fxshard
from fxshard import meta
from fxshard.models import MoEGPT, MoEGPTConfig
from fxshard.passes import run_pipeline
from fxshard.schedule import (Action, build, check_point_to_point, combine_pairs, gpipe, issue_order,
                              pair_actions, simulate, unit_costs)
from fxshard.schedule.order import pair_candidates
from fxshard.testing import assert_bit_identical, assert_step_like_eager, traced_once

c10d = torch.ops._c10d_functional


@given(kind=st.sampled_from(["1f1b", "interleaved-1f1b", "zb-h1", "gpipe", "dualpipev"]), stages=st.integers(1, 4),
       rounds=st.integers(1, 2))
def test_pairs_are_deadlock_free_hold_no_transfer_and_never_lengthen_the_step(kind, stages, rounds):
    virtual = 2 if kind in ("interleaved-1f1b", "dualpipev") else 1
    microbatches = {"interleaved-1f1b": stages * rounds, "dualpipev": 2 * stages - 2 + rounds}.get(
        kind, stages * rounds + 1)
    schedule = build(kind, stages, microbatches, virtual, extra_warmup=1)  # as the lowering builds it
    combined, pairs = combine_pairs(schedule)
    check_point_to_point(combined, issue_order(combined, (), "late", pairs), pairs)  # raises where it would hang
    check_point_to_point(combined, issue_order(combined, (), "early"), pairs)  # receives early, too
    for actions, rank_pairs in zip(issue_order(combined, (), "early"), pairs):
        for first, second in rank_pairs:
            at = actions.index(first)
            assert actions[at + 1] == second and {first.kind, second.kind} == {"F", "B"}
            assert first.mb != second.mb
    cost = unit_costs(schedule)  # what combine_pairs times them with
    assert simulate(combined, cost).makespan <= simulate(schedule, cost).makespan + 1e-9


def test_pairs_that_would_stall_the_next_stage_are_not_made():
    """A pair's forward sends its activation only after the pair. In 1F1B at P=2 that stalls stage 1
    for a whole backward: pairing stage 0's steady state (what the pairing made before) doubles the
    period, 27 -> 48 units (F=1, B=2, M=8), so no pair is made. Interleaved 1F1B with one extra
    warm-up forward per rank (Megatron's combined 1F1B) makes 24 pairs (48 of its 64 actions) at no cost; without
    the extra forward, the same pairing would take 43.5 units instead of 25.5."""
    plain = build("1f1b", 2, 8)
    assert combine_pairs(plain)[1] == ((), ())
    steady = (tuple((Action("F", 0, m + 1), Action("B", 0, m)) for m in range(7)), ())
    assert (simulate(plain).makespan, simulate(pair_actions(plain, steady)).makespan) == (27, 48)
    interleaved = build("interleaved-1f1b", 2, 8, 2, extra_warmup=1)
    combined, pairs = combine_pairs(interleaved)
    assert [len(mine) for mine in pairs] == [11, 13]
    assert simulate(combined).makespan == simulate(interleaved).makespan == 25.5
    unshifted = build("interleaved-1f1b", 2, 8, 2)
    candidates = pair_candidates(unshifted)  # every pair the pairing made before it timed them
    every = pair_actions(unshifted, candidates)
    check_point_to_point(every, issue_order(every, None, "early"), candidates)
    assert simulate(every).makespan == 43.5


def test_a_pairing_that_would_hang_is_not_made():
    """GPipe's turn: pairing each rank's last forward with its first backward closes a cycle (rank 0
    waits for a gradient that rank 1 computes only after the activation rank 0 now sends later)."""
    schedule = gpipe(2, 2)
    everything = [[(f, b) for f, b in zip(actions, actions[1:]) if f.kind == "F" and b.kind == "B" and f.mb != b.mb]
                  for actions in ([a for a in r if a.kind in ("F", "B")] for r in schedule.ranks)]  # the turn
    assert all(everything)
    with pytest.raises(fxshard.FxShardError, match="deadlock"):
        hanging = pair_actions(schedule, everything)
        check_point_to_point(hanging, issue_order(hanging), everything)
    combined, pairs = combine_pairs(schedule)
    assert sum(map(len, pairs)) < sum(map(len, everything))
    check_point_to_point(combined, issue_order(combined), pairs)


@functools.lru_cache(maxsize=4)
def pipeline_programs(kind, microbatches, interleave):
    """MoEGPT tiny under Mesh(pp=2, dp=2, ep=2) with ep_overlap: each stage's programs after every pass."""
    torch.manual_seed(0)
    model = MoEGPT(MoEGPTConfig.preset("tiny", n_layer=4 if kind in ("interleaved-1f1b", "dualpipev") else 2))
    optimizer = fxshard.optim.SGD(lr=0.05, momentum=0.9)
    mesh = fxshard.Mesh(pp=2, dp=2, ep=2)
    config = fxshard.Config(schedule=kind, microbatches=microbatches, sharding="optim_grads_params", ep_overlap=True,
                            ep_interleave=interleave, virtual_stages=2 if kind == "interleaved-1f1b" else 1)
    generator = torch.Generator().manual_seed(1)
    pieces = [{"idx": torch.randint(0, 64, (2, 16), generator=generator),
               "tgt": torch.randint(0, 64, (2, 16), generator=generator)} for _ in range(2 * microbatches)]
    layers = len(model.layers)
    program = traced_once(("combined", layers, microbatches),
                          lambda: fxshard.trace(model, lambda m, b: m.loss(b), pieces[0], optimizer=optimizer))
    stages = [run_pipeline(program, mesh, config, stage=stage) for stage in range(mesh.pp)]
    local = [{k: torch.cat([p[k] for p in pieces[i::2]]) for k in pieces[0]} for i in range(2)]
    return model, optimizer, mesh, stages, local, pieces


@settings(max_examples=2)  # each kind traces and simulates a dp=2 x pp=2 MoE pipeline (~5 s on the CI machine)
@given(kind=st.sampled_from(["1f1b", "zb-h1", "interleaved-1f1b", "dualpipev"]))
def test_combined_pipeline_changes_the_order_not_the_values(kind):
    """Against the un-rewritten program (the one before the interleave pass), on the simulator."""
    microbatches = 4
    model, optimizer, mesh, stages, local, _ = pipeline_programs(kind, microbatches, "combined-1f1b")
    assert [p.name for p in stages[0]][-2:] == ["overlap", "interleave"]
    before, after = [s[-2] for s in stages], [s[-1] for s in stages]
    for old, new in zip(before, after):
        assert sorted(n.name for n in old.graph.nodes) == sorted(n.name for n in new.graph.nodes)
    assert_bit_identical([before, after], model, optimizer, mesh,
                         [local[mesh.coords(rank)["dp"]] for rank in range(mesh.size)])


def test_paired_actions_alternate_at_each_all_to_all_and_train_like_eager():
    """Interleaved 1F1B at pp=2 with its extra warm-up forward: each stage's pairs (those that cost the
    schedule nothing) alternate between their forward and backward at every all-to-all; trains like eager."""
    from fxshard.passes import lowered_schedule

    model, optimizer, mesh, stages, local, pieces = pipeline_programs("interleaved-1f1b", 4, "combined-1f1b")
    config = fxshard.Config(schedule="interleaved-1f1b", microbatches=4, sharding="optim_grads_params",
                            ep_overlap=True, ep_interleave="combined-1f1b", virtual_stages=2)
    plan, pairs = lowered_schedule(mesh, config, stages[0][-1].stage.costs)
    assert "+1 warm-up" in plan.name and all(pairs)
    for stage, mine in zip(stages, pairs):
        program = stage[-1]
        assert f"{len(mine)} forward/backward pairs" in program.notes["interleave"]
        paired = {str(first): str(second) for first, second in mine}
        paired.update({b: f for f, b in paired.items()})
        nodes = [n for n in program.graph.nodes if n.op == "call_function" and meta.action(n) in paired]
        switches = 0
        for i, node in enumerate(nodes):
            if node.target is c10d.all_to_all_single.default:
                following = next((n for n in nodes[i + 1:] if meta.action(n) in (meta.action(node), paired[meta.action(node)])
                                  and n.target is not c10d.wait_tensor.default), None)
                switches += following is not None and meta.action(following) == paired[meta.action(node)]
        assert switches >= 4 * len(mine), switches  # a chunk's one MoE layer: dispatch and combine, F and B
    assert_step_like_eager([s[-1] for s in stages], model, optimizer, mesh,
                           [local[mesh.coords(rank)["dp"]] for rank in range(mesh.size)], pieces, lambda m, b: m.loss(b))


def test_dual_batch_is_refused_inside_pipelines():
    with pytest.raises(fxshard.FxShardError, match="dual-batch"):
        pipeline_programs("1f1b", 2, "dual-batch")
