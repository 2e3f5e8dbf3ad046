"""ZeRO inside pipelines: the schedule's U / R / G actions (fxshard.schedule.add_zero_actions) are where
the fsdp pass issues its all-gathers and gradient reductions in each stage's program."""

import collections
import functools

import torch
from hypothesis import given, strategies as st

import fxshard
from fxshard import meta, schedule as schedules
from fxshard.models import GPT, GPTConfig
from fxshard.passes import lowered_schedule, run_pipeline
from fxshard.passes.pipeline import split_stages
from fxshard.testing import assert_step_like_eager

c10d = torch.ops._c10d_functional
MESH = fxshard.Mesh(pp=2, dp=2)


def model_loss(model, batch):
    return model.loss(batch)


@functools.lru_cache(maxsize=4)
def traced(layers, tied=False):
    """GPT, or with `tied` GPT2 (embedding and head share a weight), and eight microbatches."""
    from test_foreign_models import GPT2

    torch.manual_seed(0)
    if tied:
        model, loss_fn = GPT2(vocab=40, layers=layers), lambda m, b: m(b["idx"], b["tgt"])
    else:
        model, loss_fn = GPT(GPTConfig(vocab_size=40, d_model=16, n_layer=layers, n_head=2, d_ff=24)), model_loss
    generator = torch.Generator().manual_seed(1)
    pieces = [{"idx": torch.randint(0, 40, (2, 8), generator=generator),
               "tgt": torch.randint(0, 40, (2, 8), generator=generator)} for _ in range(8)]
    optimizer = fxshard.optim.AdamW(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    return model, optimizer, pieces, fxshard.trace(model, loss_fn, pieces[0], optimizer=optimizer)


def collectives(program, target):
    return [n for n in program.graph.nodes if n.target is target and meta.phase(n) != meta.OPTIM]


def check_placement(program, chunk_params):
    """Each unit is gathered at most once per U window of a chunk that reads it, issued where the U is
    (every node of an earlier action before it, of a later one after it) and read only by that chunk's
    actions inside the window; each unit's gradient is reduced once, where its chunk's G is. Returns
    {unit: (all-gathers, U actions of the chunks holding its parameters)}."""
    actions = program.stage.actions
    nodes = list(program.graph.nodes)
    at = {n: i for i, n in enumerate(nodes)}
    made = [(at[n], meta.action_index(n)) for n in nodes if meta.action_index(n) is not None]
    windows = {}  # position of a U -> position of its R
    for index, action in enumerate(actions):
        if action.kind == "U":
            windows[index] = next(i for i in range(index, len(actions)) if actions[i] == schedules.Action("R", action.chunk))

    def issued_at(node, position):
        assert all((where < at[node]) == (index < position) for where, index in made if index != position), node

    gathers = collectives(program, c10d.all_gather_into_tensor.default)
    assert len({(n.meta[meta.UNIT], meta.action_index(n)) for n in gathers}) == len(gathers)  # one per window
    per_unit = collections.Counter(n.meta[meta.UNIT] for n in gathers)
    for gather in gathers:
        opened = meta.action_index(gather)
        chunk = actions[opened].chunk
        assert actions[opened].kind == "U" and unit_of(program, gather).members[0].name in chunk_params[chunk]
        issued_at(gather, opened)
        readers, frontier = [], list(gather.users)
        while frontier:  # the wait, the views, a recomputed cast: to the first nodes an action made
            node = frontier.pop()
            if meta.action_index(node) is None:
                frontier += node.users
            else:
                readers.append(node)
        assert readers and all(opened < meta.action_index(n) < windows[opened] and
                               actions[meta.action_index(n)].chunk == chunk for n in readers), gather
    reductions = collectives(program, c10d.reduce_scatter_tensor.default)
    assert sorted(n.meta[meta.UNIT] for n in reductions) == sorted(u.name for u in program.units if u.trainable)
    for reduction in reductions:
        if meta.action_index(reduction) is None:  # a weight tied across stages: after their all-reduce, at the end
            plan = program.stage
            assert any(sum(m.name in names for names in plan.params_by_stage) > 1 for m in unit_of(program, reduction).members)
            issued_at(reduction, len(actions))
            continue
        assert actions[meta.action_index(reduction)].kind == "G"
        issued_at(reduction, meta.action_index(reduction))
    windows_of = {u.name: sum(actions.count(schedules.Action("U", c)) for c, params in chunk_params.items()
                              if any(m.name in params for m in u.members)) for u in program.units}
    return {name: (per_unit[name], windows_of[name]) for name in windows_of}


def unit_of(program, node):
    return next(u for u in program.units if u.name == node.meta[meta.UNIT])


@given(kind=st.sampled_from(["1f1b", "interleaved-1f1b", "zb-h1", "gpipe", "dualpipev"]), prefetch=st.integers(0, 2),
       tied=st.booleans())
def test_zero3_gathers_each_unit_once_per_u_window_where_the_schedule_says(kind, prefetch, tied):
    """Mesh(pp=2, dp=2), M=4: one all-gather per unit per U action of the chunks reading it (count graph
    nodes), not one per (phase, microbatch); default policy: every chunk stays gathered for the whole
    step. A weight tied between the first and the last chunk is gathered for each (dualpipev: both on
    rank 0). The values: test_pipeline_split's test_fsdp_over_dp_inside_the_pipeline_trains_like_one_device."""
    virtual = 2 if kind in ("interleaved-1f1b", "dualpipev") else 1
    model, optimizer, pieces, program = traced(2 * virtual, tied)
    config = fxshard.Config(schedule=kind, virtual_stages=virtual, microbatches=4, sharding="optim_grads_params",
                            fsdp_prefetch=prefetch)
    plan, _ = lowered_schedule(MESH, config)
    chunks = split_stages(program, plan.chunks).chunks
    for stage in range(MESH.pp):
        final = run_pipeline(program, MESH, config, stage=stage)[-1]
        chunk_params = {c.index: set(c.params) for c in chunks if plan.rank_of(c.index) == stage}
        counts = check_placement(final, chunk_params)
        assert all(gathers == windows for gathers, windows in counts.values()), counts
        assert {windows for name, (_, windows) in counts.items() if name != "pre"} == {1}, counts  # once a step
        if "pre" in counts:  # the embedding: the head's chunk reads it too where tied to it on this rank
            assert counts["pre"][1] == (2 if tied and kind == "dualpipev" else 1), counts


def test_a_schedule_that_regathers_trains_like_one_device():
    """A user's schedule with one chunk gathered at a time (interleaved 1F1B: chunks alternate, so each
    is gathered again and again): the all-gathers follow its U windows, and the step equals eager's."""
    model, optimizer, pieces, program = traced(4)
    plain = schedules.interleaved_one_f_one_b(2, 4, 2)
    own = schedules.add_zero_actions(plain, unshard=True, prefetch=1, max_unsharded=1)
    config = fxshard.Config(schedule=own, sharding="optim_grads_params")
    stages = [run_pipeline(program, MESH, config, stage=stage)[-1] for stage in range(MESH.pp)]
    chunks = split_stages(program, own.chunks).chunks
    for stage, final in enumerate(stages):
        assert final.stage.actions == schedules.issue_order(own, receives=config.p2p_receives)[stage]
        counts = check_placement(final, {c.index: set(c.params) for c in chunks if own.rank_of(c.index) == stage})
        for unit, (gathers, windows) in counts.items():  # the embedding's backward does not read its weight:
            assert gathers == windows > 1 or unit == "pre" and 1 < gathers < windows  # B-only windows skip it
    local = [{k: torch.cat([p[k] for p in pieces[i * 4:(i + 1) * 4]]) for k in pieces[0]} for i in range(2)]
    assert_step_like_eager(stages, model, optimizer, MESH, [local[MESH.coords(r)["dp"]] for r in range(MESH.size)],
                           pieces, model_loss)


def test_zero1_reduces_at_g_and_the_dump_lists_the_zero_actions(tmp_path):
    from fxshard.dump import dump_schedule

    model, optimizer, pieces, program = traced(2)
    config = fxshard.Config(schedule="zb-h1", microbatches=4, sharding="optim")
    plan, pairs = lowered_schedule(MESH, config)
    final = run_pipeline(program, MESH, config, stage=1)[-1]
    assert not collectives(final, c10d.all_gather_into_tensor.default)  # full parameters: nothing to gather
    reductions = collectives(final, c10d.reduce_scatter_tensor.default)
    (g,) = [i for i, a in enumerate(final.stage.actions) if a.kind == "G"]
    last_w = max(i for i, a in enumerate(final.stage.actions) if a.kind == "W")
    assert g > last_w and {meta.action_index(n) for n in reductions} == {g}
    dump_schedule(plan, final.stage, tmp_path, pairs)
    text = (tmp_path / "pipeline.txt").read_text()
    assert "G1 OPT" in text and "U1" not in text
    assert "timed by its chunk's FLOPs" in text and "chunk 1: F=" in text and " W=" in text  # zb-h1 splits W
    config = fxshard.Config(schedule="1f1b", microbatches=4, sharding="optim_grads_params")
    plan, pairs = lowered_schedule(MESH, config)
    dump_schedule(plan, run_pipeline(program, MESH, config, stage=0)[-1].stage, tmp_path, pairs)
    lines = (tmp_path / "pipeline.txt").read_text().splitlines()
    assert next(line for line in lines if line.startswith("rank 0:")).startswith("rank 0: U0 F0:0")
    assert any("B0:3 G0 R0 OPT" in line for line in lines)
    assert any(line.startswith("ZeRO over dp:") for line in lines)
