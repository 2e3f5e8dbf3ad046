"""The FSDP pass: per-rank programs (SPMD simulator) train like the single-device program."""

import operator

import pytest
import torch
from hypothesis import given, strategies as st

import fxshard
from fxshard import meta
from fxshard.models import GPT, GPTConfig
from fxshard.passes.fsdp import STRATEGIES, FSDPConfig, fsdp
from fxshard.program import Input, InputKind, OutputKind
from fxshard.testing import SimulatedRanks
from strategies import MLPStack, mse, regression_batch, widths, worlds

ADAMW = fxshard.optim.AdamW(lr=1e-2, weight_decay=0.1)
c10d = torch.ops._c10d_functional


def single_device_run(model, batches, optimizer, clip=None):
    config = fxshard.Config(clip_grad_norm=clip)  # no microbatches: the reference for accumulation too
    step = fxshard.shard(model, mse, batches[0], optimizer=optimizer, config=config)
    losses = [step(batch)["loss"] for batch in batches]
    return losses, step.parameters()


def split(batch, world):
    rows = batch["x"].shape[0] // world
    return [{k: v[r * rows:(r + 1) * rows] for k, v in batch.items()} for r in range(world)]


def check_fsdp_matches(model, world, strategy, optimizer, steps=2, local_rows=2, clip=None, prefetch=1,
                       microbatches=1):
    generator = torch.Generator().manual_seed(0)
    batches = [regression_batch(generator, world * local_rows) for _ in range(steps)]
    ref_losses, ref_params = single_device_run(model, batches, optimizer, clip)
    local = fxshard.trace(model, mse, split(batches[0], world)[0], optimizer=optimizer,
                          config=fxshard.Config(clip_grad_norm=clip, microbatches=microbatches))
    program = fsdp(local, FSDPConfig(world, strategy, prefetch))
    ranks = SimulatedRanks(program, model, optimizer, fxshard.Mesh(dp=world))
    for batch, ref_loss in zip(batches, ref_losses):
        metrics = ranks.step(split(batch, world))
        for rank_metrics in metrics:
            assert torch.allclose(rank_metrics["loss"], ref_loss, rtol=1e-5, atol=1e-7)
    for rank in range(world):
        params = ranks.parameters(rank)
        assert set(params) == set(ref_params)
        for name, value in ref_params.items():
            # fp32, 1e-5 relative; atol covers parameters that sit near zero, where the reductions'
            # different summation order (per rank, then over ranks) shows as ~1e-8 absolute
            assert torch.allclose(params[name], value, rtol=1e-5, atol=1e-6), (name, rank)
    return program


@given(widths=widths, world=worlds, strategy=st.sampled_from(STRATEGIES), prefetch=st.integers(0, 2),
       use_sgd=st.booleans(), microbatches=st.sampled_from([1, 2]))
def test_every_strategy_matches_the_single_device_program(widths, world, strategy, prefetch, use_sgd,
                                                          microbatches):
    torch.manual_seed(0)
    optimizer = fxshard.optim.SGD(lr=0.1, momentum=0.9) if use_sgd else ADAMW
    check_fsdp_matches(MLPStack(widths), world, strategy, optimizer, prefetch=prefetch,
                       local_rows=2 * microbatches, microbatches=microbatches)


def test_accumulation_reduces_once_per_unit_and_gathers_once_per_microbatch():
    torch.manual_seed(0)
    program = check_fsdp_matches(MLPStack([4, 3]), 2, "optim_grads_params", ADAMW, local_rows=6, microbatches=3)
    collectives = [n for n in program.graph.nodes if meta.COMM_BYTES in n.meta and meta.UNIT in n.meta]
    for unit in program.units:
        mine = [n for n in collectives if n.meta[meta.UNIT] == unit.name]
        scatters = [n for n in mine if n.target is c10d.reduce_scatter_tensor.default]
        gathers = [n for n in mine if n.target is c10d.all_gather_into_tensor.default]
        assert len(scatters) == 1
        assert len([g for g in gathers if meta.phase(g) == meta.FWD]) == 3  # one per microbatch


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_parameters_smaller_than_the_world_do_not_corrupt_neighbours(strategy):
    # 1-element biases and 1x1 weights across 8 ranks: most ranks hold none of a given parameter.
    torch.manual_seed(0)
    program = check_fsdp_matches(MLPStack([1, 1, 2]), 8, strategy, ADAMW, steps=3)
    assert all(unit.numel < 8 or unit.padding > 0 for unit in program.units if unit.numel % 8)


class TwoBiases(torch.nn.Module):
    """y = W x + (a + b): autograd gives a and b one gradient node."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Linear(3, 1, bias=False)
        self.a, self.b = torch.nn.Parameter(torch.randn(1)), torch.nn.Parameter(torch.randn(1))

    def forward(self, x):
        return self.w(x) + (self.a + self.b)


@pytest.mark.parametrize("strategy", ["no_shard", "optim_grads_params"])
def test_parameters_that_share_one_gradient_node_each_get_theirs(strategy):
    torch.manual_seed(0)
    check_fsdp_matches(TwoBiases(), 2, strategy, ADAMW)


def test_global_norm_clipping_uses_all_shards():
    torch.manual_seed(0)
    check_fsdp_matches(MLPStack([5, 3]), 3, "optim_grads_params", ADAMW, clip=0.05)


def gpt_zero3(world=2, prefetch=1, no_decay=(), **overrides):
    torch.manual_seed(0)
    batch = {"idx": torch.zeros(2, 8, dtype=torch.long), "tgt": torch.zeros(2, 8, dtype=torch.long)}
    optimizer = fxshard.optim.AdamW(lr=1e-3, weight_decay=0.1, no_decay=no_decay)
    program = fxshard.trace(GPT(GPTConfig.preset("tiny", **overrides)), lambda m, b: m.loss(b), batch,
                            optimizer=optimizer)
    return fsdp(program, FSDPConfig(world, "optim_grads_params", prefetch))


def test_zero3_casts_each_parameter_shard_to_the_compute_dtype_once_a_step():
    """bf16 compute: a unit's shard is cast before its all-gather (half the bytes), and the backward's
    second gather of a block reads the forward's cast instead of casting the fp32 shard again."""
    torch.manual_seed(0)
    batch = {"idx": torch.zeros(2, 8, dtype=torch.long), "tgt": torch.zeros(2, 8, dtype=torch.long)}
    traced = fxshard.trace(GPT(GPTConfig.preset("tiny")), lambda m, b: m.loss(b), batch,
                           config=fxshard.Config(param_dtype=torch.bfloat16))
    program = fsdp(traced, FSDPConfig(2, "optim_grads_params"))
    shards = {node for node, spec in zip(program.placeholders(), program.inputs)
              if spec.kind is InputKind.PARAM and spec.unit is not None}
    casts = [n for n in program.graph.nodes if n.target is torch.ops.aten._to_copy.default and n.args[0] in shards]
    gathers = [n for n in program.graph.nodes if n.target is c10d.all_gather_into_tensor.default]
    assert sorted(c.args[0].name for c in casts) == sorted(s.name for s in shards)  # one cast per unit
    assert len(gathers) > len(casts) and all(g.args[0] in casts for g in gathers)  # the blocks gathered twice
    assert all(g.args[0].meta["val"].dtype == torch.bfloat16 for g in gathers)


@pytest.mark.parametrize("no_decay, vocab, layers", [((), 64, 4), (("*norm*",), 64, 4), ((), 20000, 4),
                                                      ((), 20000, 2)])
def test_all_gathers_are_prefetched_one_unit_ahead_and_waited_just_before_use(no_decay, vocab, layers):
    """Every unit waits just before its first use. The blocks are gathered one block ahead: with the
    norm gains exempt, their small units (`layers:no_decay`, `post:no_decay`) ride along instead of
    taking a block's place; and an embedding far larger than the blocks (vocabulary 20000) must not
    make every block a rider (which gathered them all at once), even in a model of two blocks."""
    program = gpt_zero3(no_decay=no_decay, vocab_size=vocab, n_layer=layers)
    nodes = list(program.graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    gathers = [n for n in nodes if n.target is c10d.all_gather_into_tensor.default and meta.phase(n) != meta.OPTIM]
    for phase in (meta.FWD, meta.BWD):
        ordered = [g for g in gathers if meta.phase(g) == phase]
        # forward: pre, the blocks, post; the backward begins with "post", whose forward copy it keeps
        # (nothing is gathered in between), and the embedding's backward needs no weight, so neither
        # "post" nor "pre" is gathered again
        blocks = [f"layers.{i}" for i in range(layers)]
        expected = ["pre", *blocks, "post"] if phase == meta.FWD else blocks[::-1]
        assert [g.meta[meta.UNIT] for g in ordered if ":" not in g.meta[meta.UNIT]] == expected
        first_uses = {}
        for gather in ordered:
            (wait,) = gather.users
            views = [v for s in wait.users for v in s.users]
            users = [u for v in views for u in v.users]
            first_use = first_uses[gather] = min(users, key=position.get)
            # nothing but this unit's views sits between the wait and the first use of a parameter
            between = nodes[position[wait] + 1:position[first_use]]
            assert all(n in views or n in wait.users or n.target is c10d.all_gather_into_tensor.default
                       for n in between), [n.name for n in between]
        block = [g for g in ordered if g.meta[meta.UNIT] in blocks]
        for index in range(1, len(block)):  # block k is issued before block k-1 is first used
            assert position[block[index]] < position[first_uses[block[index - 1]]]
        for index in range(2, len(block)):  # and after block k-2 is: one unit ahead, not more
            assert position[block[index]] > position[first_uses[block[index - 2]]]
    riders = program.notes["fsdp"].partition("not counted: ")[2]
    assert ("layers:no_decay" in riders) == bool(no_decay) and "layers.0" not in riders  # the dump names them


def test_reduce_scatters_follow_their_last_gradient_and_wait_in_the_optimizer_phase():
    program = gpt_zero3()
    nodes = list(program.graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    last_backward = max(position[n] for n in nodes if meta.phase(n) == meta.BWD
                        and n.target is not c10d.reduce_scatter_tensor.default)
    scatters = [n for n in nodes if n.target is c10d.reduce_scatter_tensor.default]
    assert {s.meta[meta.UNIT] for s in scatters} == {"pre", "layers.0", "layers.1", "post"}
    for scatter in scatters:
        (wait,) = scatter.users
        assert meta.phase(wait) == meta.OPTIM and position[wait] > last_backward
        if meta.phase(scatter) == meta.OPTIM:  # deferred (test_the_last_reductions_run_under_the_updates)
            continue
        unit = next(u for u in program.units if u.name == scatter.meta[meta.UNIT])
        # gradients carry their parameter's name; the all-gather's views carry it too, and the unit
        grads = [n for n in nodes if meta.phase(n) == meta.BWD and meta.param(n) in {m.name for m in unit.members}
                 and meta.UNIT not in n.meta]
        last_grad = max(grads, key=position.get)
        chain = nodes[position[last_grad] + 1:position[scatter]]
        assert all(n.target in (torch.ops.aten.view.default, torch.ops.aten.cat.default,
                                torch.ops.aten.constant_pad_nd.default, torch.ops.aten._unsafe_view.default)
                   for n in chain), [n.name for n in chain]


@pytest.mark.parametrize("nonfinite", ["raise", "ignore"])
def test_the_last_reductions_run_under_the_updates(nonfinite):
    """The units whose gradients the backward makes last (the last layer it reaches, and "pre") are
    reduced in the optimizer phase: issued before any update (after the non-finite guard's one
    scalar all-reduce), waited after every other unit's update, then updated themselves."""
    torch.manual_seed(0)
    batch = {"idx": torch.zeros(2, 8, dtype=torch.long), "tgt": torch.zeros(2, 8, dtype=torch.long)}
    program = fsdp(fxshard.trace(GPT(GPTConfig.preset("tiny")), lambda m, b: m.loss(b), batch,
                                 config=fxshard.Config(nonfinite=nonfinite)),
                   FSDPConfig(2, "optim_grads_params", 1))
    nodes = list(program.graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    deferred = [n for n in nodes if n.target is c10d.reduce_scatter_tensor.default and meta.phase(n) == meta.OPTIM]
    assert sorted(n.meta[meta.UNIT] for n in deferred) == ["layers.0", "pre"]
    updates = {meta.param(n): n for n in nodes if n.target is torch.ops.fxshard.adamw_update.default}
    assert set(updates) == {"pre", "layers.0", "layers.1", "post"}
    first_update = min(position[n] for n in updates.values())
    scalar_reductions = [n for n in nodes if n.target is c10d.all_reduce.default and meta.phase(n) == meta.OPTIM
                         and position[n] < first_update]
    assert len(scalar_reductions) == (1 if nonfinite == "raise" else 0)
    assert all(position[n] < position[scatter] for n in scalar_reductions for scatter in deferred)
    for scatter in deferred:
        (wait,) = scatter.users
        assert meta.COMM_BYTES in scatter.meta and position[scatter] < first_update
        assert all(position[updates[name]] < position[wait] for name in ("layers.1", "post"))
        assert position[wait] < position[updates[scatter.meta[meta.UNIT]]]


def test_with_clipping_every_reduction_follows_its_last_gradient():
    torch.manual_seed(0)
    batch = {"idx": torch.zeros(2, 8, dtype=torch.long), "tgt": torch.zeros(2, 8, dtype=torch.long)}
    program = fsdp(fxshard.trace(GPT(GPTConfig.preset("tiny")), lambda m, b: m.loss(b), batch,
                                 config=fxshard.Config(clip_grad_norm=1.0)), FSDPConfig(2, "optim_grads_params", 1))
    scatters = [n for n in program.graph.nodes if n.target is c10d.reduce_scatter_tensor.default]
    assert len(scatters) == 4 and all(meta.phase(n) == meta.BWD for n in scatters)


def test_zero3_holds_a_quarter_of_the_state_per_rank():
    single = fxshard.trace(GPT(GPTConfig.preset("tiny")), lambda m, b: m.loss(b),
                           {"idx": torch.zeros(2, 8, dtype=torch.long), "tgt": torch.zeros(2, 8, dtype=torch.long)})
    per_rank = gpt_zero3(world=4)

    def state_bytes(program):
        return sum(torch.Size(i.shape).numel() * i.dtype.itemsize for i in program.inputs
                   if i.kind in (InputKind.PARAM, InputKind.OPT_STATE))

    padding = sum(u.padding for u in per_rank.units) * 4 * 3  # params + two Adam slots, fp32
    assert state_bytes(per_rank) <= state_bytes(single) / 4 + padding
    assert state_bytes(per_rank) >= state_bytes(single) / 4


def test_optimizer_slots_and_units_say_what_they_belong_to_in_fields_matching_their_names():
    """Traced: each trainable parameter's AdamW slots name it (`owner`) and the slot; after ZeRO-3 each
    unit's parameter input and slots name the unit, and the slots' owner is that unit's input. The
    names ("exp_avg/<param>", "unit/<unit>", "exp_avg/unit/<unit>") key state and checkpoints."""
    torch.manual_seed(0)
    batch = {"idx": torch.zeros(2, 8, dtype=torch.long), "tgt": torch.zeros(2, 8, dtype=torch.long)}
    traced = fxshard.trace(GPT(GPTConfig.preset("tiny")), lambda m, b: m.loss(b), batch, optimizer=ADAMW)
    sharded = fsdp(traced, FSDPConfig(2, "optim_grads_params"))
    for program, owners in ((traced, {p.name: None for p in traced.inputs_of(InputKind.PARAM)}),
                            (sharded, {f"unit/{u.name}": u for u in sharded.units})):
        for specs in (program.inputs_of(InputKind.OPT_STATE), program.outputs_of(OutputKind.OPT_STATE)):
            assert sorted((s.owner, s.slot) for s in specs) == sorted(
                (owner, slot) for owner in owners for slot in ("exp_avg", "exp_avg_sq"))
            for spec in specs:
                assert spec.name == f"{spec.slot}/{spec.owner}" and program.unit_of(spec) is owners[spec.owner]
    assert all(spec.unit is None for spec in traced.inputs_of(InputKind.PARAM))
    for spec in [*sharded.inputs_of(InputKind.PARAM), *sharded.outputs_of(OutputKind.PARAM)]:
        assert spec.name == f"unit/{spec.unit}" and sharded.unit_of(spec).name == spec.unit
    with pytest.raises(ValueError, match="does not match its fields"):
        Input(InputKind.OPT_STATE, "exp_avg/layers.0.weight", (4,), torch.float32)  # no owner, no slot


def test_peak_memory_per_rank_falls_with_zero3(capsys):
    from fxshard.dump import peak_live_bytes

    torch.manual_seed(0)
    batch = {"idx": torch.zeros(2, 8, dtype=torch.long), "tgt": torch.zeros(2, 8, dtype=torch.long)}
    single = fxshard.trace(GPT(GPTConfig.preset("tiny")), lambda m, b: m.loss(b), batch)
    peaks = {"single": peak_live_bytes(single)}
    for strategy in ("no_shard", "optim_grads_params"):
        peaks[strategy] = peak_live_bytes(fsdp(single, FSDPConfig(4, strategy)))
    with capsys.disabled():
        print("\nGPT tiny, world 4, per-rank peak live bytes (program accounting): " +
              ", ".join(f"{k} {v / 2**20:.2f} MiB" for k, v in peaks.items()))
    assert peaks["optim_grads_params"] < 0.6 * peaks["no_shard"]
    assert peaks["no_shard"] >= peaks["single"] * 0.95


@given(widths=widths, world=worlds, strategy=st.sampled_from(STRATEGIES), data=st.data())
def test_frozen_parameters_are_sharded_under_zero3_and_never_change(widths, world, strategy, data):
    torch.manual_seed(0)
    model = MLPStack(widths)
    names = [name for name, _ in model.named_parameters()]
    frozen = data.draw(st.sets(st.sampled_from(names), max_size=len(names) - 1), label="frozen")
    for name, p in model.named_parameters():
        p.requires_grad_(name not in frozen)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    program = check_fsdp_matches(model, world, strategy, ADAMW)
    frozen_units = [u for u in program.units if not u.trainable]
    if strategy == "optim_grads_params":
        assert {m.name for u in frozen_units for m in u.members} == frozen
        shard_inputs = {i.unit: i for i in program.inputs_of(InputKind.PARAM)}
        for unit in frozen_units:
            spec = shard_inputs[unit.name]
            assert spec.placement.kind == "sharded" and spec.shape == (unit.shard_numel,)
            assert not any(o.unit == unit.name for o in program.outputs)  # never updated
    else:
        assert not frozen_units
    # (check_fsdp_matches compared every parameter after training, frozen ones included);
    # the frozen shards also gather back into exactly the model's tensors
    ranks_params = SimulatedRanks(program, model, ADAMW, fxshard.Mesh(dp=world)).parameters(0)
    for name in frozen:
        assert torch.equal(ranks_params[name], before[name])


def test_zero1_gathers_each_updated_shard_under_the_updates_that_follow():
    """ZeRO-1 all-gathers every updated shard: the units that have such a gather are updated first,
    each gather issued right after its update and waited at the end; the units with no collective
    (experts at dp = ep: one-rank axis) are updated last, under the deferred units' gathers. The
    reported metrics' sums are issued in the forward, where they exist."""
    from fxshard.models import MoEGPT, MoEGPTConfig
    from fxshard.passes import run_pipeline

    torch.manual_seed(0)
    model = MoEGPT(MoEGPTConfig(vocab_size=16, d_model=8, n_layer=2, n_head=2, n_expert=4, top_k=2, d_ff_expert=8))
    batch = {"idx": torch.zeros(2, 4, dtype=torch.long), "tgt": torch.zeros(2, 4, dtype=torch.long)}
    config = fxshard.Config(sharding="optim")
    program = run_pipeline(fxshard.trace(model, lambda m, b: m.loss_and_metrics(b), batch, optimizer=ADAMW,
                                         config=config), fxshard.Mesh(dp=2, ep=2), config)[-1]
    nodes = list(program.graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    updates = [n for n in nodes if n.target is torch.ops.fxshard.adamw_update.default]
    gathers = {n.meta[meta.UNIT]: n for n in nodes
               if n.target is c10d.all_gather_into_tensor.default and meta.phase(n) == meta.OPTIM}
    units = {u.name: u for u in program.units}
    order = [meta.param(n) for n in updates]
    assert set(gathers) == {name for name in order if units[name].world > 1}
    assert all(units[name].world == 1 for name in order[len(gathers):])  # gathered units first
    for update in updates:
        name = meta.param(update)
        if name in gathers:  # nothing but the update's own outputs between it and its gather's issue
            between = nodes[position[update] + 1:position[gathers[name]]]
            assert all(n.target is operator.getitem and n.args[0] is update for n in between), between
            (wait,) = gathers[name].users
            assert position[wait] > position[updates[-1]]
    deferred = [n for n in nodes if n.target is c10d.reduce_scatter_tensor.default and meta.phase(n) == meta.OPTIM]
    assert deferred and all(position[n] < position[updates[0]] for n in deferred)
    metric_sums = [n for n in nodes if n.target is c10d.all_reduce.default and meta.phase(n) == meta.FWD]
    assert len(metric_sums) == 1 + len(program.outputs_of(OutputKind.METRIC))  # the loss's mean and the metrics
