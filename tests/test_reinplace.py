"""The runtime's in-place lowering of optimizer updates (fxshard/runtime/reinplace.py)."""

import torch

import fxshard
from fxshard import meta
from fxshard.models import GPT, GPTConfig
from fxshard.program import InputKind, OutputKind
from fxshard.runtime.reinplace import gather_updates_in_place, reinplace, write_back_positions

ADAMW = fxshard.optim.AdamW(lr=1e-2, weight_decay=0.1)
IN_PLACE_ACCUMULATIONS = (torch.ops.fxshard.matmul_accumulate_.default, torch.ops.fxshard.embedding_accumulate_.default)
C10D = torch.ops._c10d_functional


def _batch(seed):
    generator = torch.Generator().manual_seed(seed)
    return {"idx": torch.randint(0, 32, (2, 8), generator=generator),
            "tgt": torch.randint(0, 32, (2, 8), generator=generator)}


def _model():
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=32, d_model=16, n_layer=2, n_head=2, d_ff=32))


def test_every_adamw_update_is_lowered_and_outputs_alias_their_inputs():
    program = fxshard.trace(_model(), lambda m, b: m.loss(b), _batch(0), optimizer=ADAMW)
    lowered, count = reinplace(program.graph_module)
    functional = [n for n in program.graph.nodes if n.target is torch.ops.fxshard.adamw_update.default]
    assert count == len(functional) == sum(1 for _ in _model().parameters())
    targets = {n.target for n in lowered.graph.nodes}
    assert torch.ops.fxshard.adamw_update.default not in targets
    assert torch.ops.fxshard.adamw_update_.default in targets
    # the lowered graph, run on copies of the inputs, returns those inputs updated to the functional values
    args = [torch.randn(spec.shape, dtype=spec.dtype) if spec.dtype.is_floating_point else
            torch.randint(0, 32, spec.shape) for spec in program.inputs]
    for index, spec in enumerate(program.inputs):
        if spec.kind.name in ("LR", "STEP"):
            args[index] = torch.tensor(1e-2 if spec.kind.name == "LR" else 3.0)
        elif spec.slot == "exp_avg_sq":
            args[index] = args[index].abs()
    expected = program.graph_module(*[a.clone() for a in args])
    copies = [a.clone() for a in args]
    actual = lowered(*copies)
    for spec, want, got in zip(program.outputs, expected, actual):
        assert torch.equal(want, got), spec.name
        if spec.kind.name in ("PARAM", "OPT_STATE"):
            assert any(got is c for c in copies), f"{spec.name} is not its input, updated"


def test_a_reader_after_the_update_keeps_the_functional_form():
    program = fxshard.trace(_model(), lambda m, b: m.loss(b), _batch(0), optimizer=ADAMW)
    graph_module = program.graph_module
    graph = graph_module.graph
    update = next(n for n in graph.nodes if n.target is torch.ops.fxshard.adamw_update.default)
    param = update.args[0]
    output = next(n for n in graph.nodes if n.op == "output")
    with graph.inserting_before(output):
        late_read = graph.call_function(torch.ops.aten.mul.Tensor, (param, 2.0))
    output.args = ((*output.args[0], late_read),)
    lowered, count = reinplace(torch.fx.GraphModule(graph_module, graph))
    assert count == sum(1 for _ in _model().parameters()) - 1
    kept = [n for n in lowered.graph.nodes if n.target is torch.ops.fxshard.adamw_update.default]
    assert [n.args[0].name for n in kept] == [param.name]


def test_a_metric_that_is_a_parameter_reports_its_value_before_the_update_and_stays_as_returned():
    class Tempered(torch.nn.Module):  # a learnable temperature, reported: read through detach + view
        def __init__(self):
            super().__init__()
            self.lin, self.temp = torch.nn.Linear(4, 4), torch.nn.Parameter(torch.ones(1))

        def forward(self, x):
            return (self.lin(x) * self.temp).pow(2).mean()

    batch = {"x": torch.randn(8, 4, generator=torch.Generator().manual_seed(0))}
    step = fxshard.shard(Tempered(), lambda m, b: (m(b["x"]), {"temp": m.temp}), batch, optimizer=ADAMW)
    assert step.in_place_updates == 2  # the Linear's weight and bias; temp keeps the functional form
    first = step(batch)["temp"]
    assert first.item() == 1.0
    step(batch)
    assert first.item() == 1.0 and step.parameters()["temp"].item() < 1.0


def test_shard_leaves_the_users_model_unchanged_and_parameters_are_snapshots():
    model = _model()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    step = fxshard.shard(model, lambda m, b: m.loss(b), _batch(0), optimizer=ADAMW)
    step(_batch(0))
    snapshot = step.parameters()
    kept = {name: value.clone() for name, value in snapshot.items()}
    step(_batch(1))
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name
    for name, value in snapshot.items():
        assert torch.equal(value, kept[name]), name
    assert any(not torch.equal(kept[name], value) for name, value in step.parameters().items())


def test_zero1_shards_and_one_rank_units_update_in_place_with_the_same_values():
    """ZeRO-1 over dp=2 with experts on ep=2 (so the expert units' axis, edp, has one rank): every
    update is lowered (the shard where it lies, the moments in their inputs), every gathered unit is
    gathered into its flat parameter, the expert units have no collectives at all, and training is
    bit-identical to the functional program: nothing is left to copy back."""
    from fxshard.models import MoEGPT, MoEGPTConfig
    from fxshard.passes import run_pipeline
    from fxshard.program import OutputKind
    from fxshard.testing import assert_bit_identical
    from strategies import rank_batches

    torch.manual_seed(0)
    model = MoEGPT(MoEGPTConfig.preset("tiny"))
    mesh, local, config = fxshard.Mesh(dp=2, ep=2), rank_batches(2, 2), fxshard.Config(sharding="optim")
    program = run_pipeline(fxshard.trace(model, lambda m, b: m.loss_and_metrics(b), local[0], optimizer=ADAMW,
                                         config=config), mesh, config)[-1]
    lowered, count = reinplace(program.graph_module)
    assert count == len(program.units)
    lowered, gathers = gather_updates_in_place(lowered, write_back_positions(program))
    gathered = [u for u in program.units if u.world > 1]
    assert gathered and gathers == len(gathered)
    edp = [n for n in program.graph.nodes if n.op == "call_function" and "edp" in n.args]
    assert edp == []  # nothing to gather or reduce over one rank
    output = next(n for n in lowered.graph.nodes if n.op == "output")
    placeholders = [n for n in lowered.graph.nodes if n.op == "placeholder"]
    inputs = {(spec.kind.name, spec.name): node for spec, node in zip(program.inputs, placeholders)}
    for spec, value in zip(program.outputs, output.args[0]):
        if spec.kind is OutputKind.OPT_STATE or (spec.kind is OutputKind.PARAM and "experts" in spec.name):
            assert value in placeholders, spec.name  # updated in place: no copy back
        elif spec.kind is OutputKind.PARAM:  # waits for the gather that writes into the parameter itself
            assert value.target is C10D.wait_tensor.default, spec.name
            assert value.args[0].target is C10D.all_gather_into_tensor_out.default, spec.name
            assert value.args[0].kwargs["out"] is inputs["PARAM", spec.name], spec.name
    assert_bit_identical([program, program.replace(graph_module=lowered)], model, ADAMW, mesh, local)


def test_a_view_of_an_input_is_not_a_temporary():
    from fxshard.runtime.reinplace import _temporary

    graph = torch.fx.Graph()
    flat = graph.placeholder("flat")
    shard = graph.call_function(torch.ops.aten.slice.Tensor, (flat, 0, 0, 4))
    fresh = graph.call_function(torch.ops.aten.index_select.default, (flat, 0, flat))
    view = graph.call_function(torch.ops.aten.view.default, (fresh, [4]))
    update = graph.call_function(torch.ops.aten.add.Tensor, (shard, view))
    assert not _temporary(shard, update)      # writing it would write the input
    assert _temporary(view, update)           # a view of fresh memory that only `update` reads
    graph.call_function(torch.ops.aten.neg.default, (fresh,))
    assert not _temporary(view, update)       # the fresh tensor has another reader


def _zero(strategy):
    """GPT tiny under ZeRO `strategy` over dp=2: the model, mesh, each rank's batch and the program."""
    from fxshard.passes import run_pipeline

    model, mesh, config = _model(), fxshard.Mesh(dp=2), fxshard.Config(sharding=strategy)
    local = [_batch(seed) for seed in range(2)]
    program = run_pipeline(fxshard.trace(model, lambda m, b: m.loss(b), local[0], optimizer=ADAMW, config=config),
                           mesh, config)[-1]
    return model, mesh, local, program


def _gathers_into(graph_module):
    return [n for n in graph_module.graph.nodes if n.target is C10D.all_gather_into_tensor_out.default]


def _assert_gathered_into_their_parameters(program, lowered):
    """Every PARAM output that waits for a gather waits for one into that parameter's own input."""
    output = next(n for n in lowered.graph.nodes if n.op == "output")
    placeholders = [n for n in lowered.graph.nodes if n.op == "placeholder"]
    inputs = {(spec.kind, spec.name): node for spec, node in zip(program.inputs, placeholders)}
    into = 0
    for spec, value in zip(program.outputs, output.args[0]):
        if spec.kind is OutputKind.PARAM and getattr(value, "target", None) is C10D.wait_tensor.default:
            assert value.args[0].target is C10D.all_gather_into_tensor_out.default, spec.name
            assert value.args[0].kwargs["out"] is inputs[InputKind.PARAM, spec.name], spec.name
            into += 1
    return into


def test_zero2_gathers_each_updated_shard_into_its_parameter_and_trains_bit_identically():
    from fxshard.testing import assert_bit_identical

    model, mesh, local, program = _zero("optim_grads")
    lowered, gathers = gather_updates_in_place(reinplace(program.graph_module)[0], write_back_positions(program))
    assert gathers == len(program.units) == len(_gathers_into(lowered)) == _assert_gathered_into_their_parameters(
        program, lowered)
    assert not [n for n in lowered.graph.nodes if n.target is C10D.all_gather_into_tensor.default]
    assert_bit_identical([program, program.replace(graph_module=lowered)], model, ADAMW, mesh, local, steps=3)


def test_zero3_has_nothing_to_gather_into():
    _, _, _, zero3 = _zero("optim_grads_params")  # its updated shards are the state: no gather after the update
    assert gather_updates_in_place(reinplace(zero3.graph_module)[0], write_back_positions(zero3))[1] == 0


def test_a_flat_parameter_read_later_or_asynchronously_or_returned_twice_keeps_its_gather():
    """Under ZeRO-1, each of these keeps exactly its own gather functional (the others are rewritten):
    the flat parameter read after its gather through an alias chain (detach, then view), a view of one
    read by a collective before its gather (on another stream until its wait), and a gathered value
    that is also returned as a metric (which would then alias the state)."""
    _, _, _, program = _zero("optim")
    graph_module = reinplace(program.graph_module)[0]
    graph = graph_module.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    positions = write_back_positions(program)
    output = next(n for n in graph.nodes if n.op == "output")
    gathered = [(o, placeholders[i]) for o, i in positions.items()
                if getattr(output.args[0][o], "target", None) is C10D.wait_tensor.default]
    assert len(gathered) >= 4
    (late_one, late_target), (async_one, async_target), (twice, _) = gathered[:3]
    with graph.inserting_before(output):  # the old value read after the gather, through detach + view
        viewed = graph.call_function(torch.ops.aten.view.default,
                                     (graph.call_function(torch.ops.aten.detach.default, (late_target,)), [-1]))
        late = graph.call_function(torch.ops.aten.sum.default, (viewed,))
    with graph.inserting_before(output.args[0][async_one].args[0]):  # a view of it reduced before the gather
        view = graph.call_function(torch.ops.aten.view.default, (async_target, [-1]))
        reduced = graph.call_function(C10D.all_reduce.default, (view, "sum", "dp"))
        graph.call_function(C10D.wait_tensor.default, (reduced,))
    output.args = ((*output.args[0], late, output.args[0][twice]),)  # the last: a metric that is a gathered value
    lowered, gathers = gather_updates_in_place(torch.fx.GraphModule(graph_module, graph), positions)
    assert gathers == len(gathered) - 3
    lowered_output = next(n for n in lowered.graph.nodes if n.op == "output")
    for position in (late_one, async_one, twice):
        assert lowered_output.args[0][position].args[0].target is C10D.all_gather_into_tensor.default, position
    for position, _ in gathered[3:]:
        assert lowered_output.args[0][position].args[0].target is C10D.all_gather_into_tensor_out.default, position


def test_a_shard_that_may_alias_its_flat_parameter_keeps_its_gather():
    from fxshard.runtime.reinplace import _aliases

    graph = torch.fx.Graph()
    flat = graph.placeholder("flat")
    sliced = graph.call_function(torch.ops.aten.slice.Tensor, (flat, 0, 0, 4))
    viewed = graph.call_function(torch.ops.aten.view.default, (sliced, [4]))
    fresh = graph.call_function(torch.ops.aten.index_select.default, (flat, 0, flat))
    assert _aliases(viewed, flat) and _aliases(flat, flat)
    assert not _aliases(graph.call_function(torch.ops.aten.view.default, (fresh, [4])), flat)


def test_fused_gradient_accumulations_add_in_place_and_train_bit_identically():
    """Config(fuse_grad_accumulation) at pp=2, M=3: every fused accumulation's total is a temporary of
    the stage's step (the first microbatch's gradient widened, then the accumulations), so the runtime
    lowers each one to the in-place GEMM (the embedding's to the in-place row sum), placed at the end of its layer's run of compute; on the SPMD
    simulator the lowered stages train bit-identically to the functional ones."""
    from fxshard.codegen import find_regions, is_fixed
    from fxshard.passes import run_pipeline
    from fxshard.runtime.reinplace import accumulate_in_place
    from fxshard.testing import assert_bit_identical

    model, mesh = _model(), fxshard.Mesh(pp=2)
    precision = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}
    one = {k: v[:1] for k, v in _batch(0).items()}
    traced = fxshard.trace(model, lambda m, b: m.loss(b), one, optimizer=ADAMW, config=fxshard.Config(**precision))
    config = fxshard.Config(microbatches=3, fuse_grad_accumulation=True, sharding="no_shard", **precision)
    stages = [run_pipeline(traced, mesh, config, stage=s)[-1] for s in range(2)]
    lowered = []
    for stage in stages:
        graph_module, count = accumulate_in_place(stage.graph_module)
        assert count == stage.notes["fuse_grad_accumulation"] > 0
        targets = [n.target for n in graph_module.graph.nodes]
        assert not {torch.ops.fxshard.matmul_accumulate.default, torch.ops.fxshard.embedding_accumulate.default} & \
            set(targets)
        assert sum(t in IN_PLACE_ACCUMULATIONS for t in targets) == count
        assert (torch.ops.fxshard.embedding_accumulate_.default in targets) == (stage is stages[0])
        for node in graph_module.graph.nodes:
            if node.target in IN_PLACE_ACCUMULATIONS:  # ends its layer's run of compute
                after = node.next
                assert is_fixed(after) or node.args[0] in after.all_input_nodes or \
                    (meta.layer(after), meta.microbatch(after)) != (meta.layer(node), meta.microbatch(node))
        # cut where layers change anyway: at most one more region per layer and microbatch that accumulates
        added = len(find_regions(graph_module.graph)) - len(find_regions(stage.graph))
        assert 0 <= added <= len({(meta.layer(n), meta.microbatch(n)) for n in graph_module.graph.nodes
                                  if n.target in IN_PLACE_ACCUMULATIONS})
        lowered.append(stage.replace(graph_module=graph_module))
    generator = torch.Generator().manual_seed(1)
    batches = [{k: torch.randint(0, 32, (3, 8), generator=generator) for k in ("idx", "tgt")}] * 2
    assert_bit_identical([stages, lowered], model, ADAMW, mesh, batches, steps=2)


def test_an_accumulation_into_an_input_or_a_total_read_elsewhere_stays_functional():
    from fxshard.runtime.reinplace import accumulate_in_place

    graph = torch.fx.Graph()
    total, a, b = (graph.placeholder(name) for name in ("total", "a", "b"))
    into_input = graph.call_function(torch.ops.fxshard.matmul_accumulate.default, (total, a, b))
    fresh = graph.call_function(torch.ops.aten.mul.Tensor, (total, 2.0))
    read_twice = graph.call_function(torch.ops.fxshard.matmul_accumulate.default, (fresh, a, b))
    graph.output((into_input, read_twice, fresh))
    module = torch.fx.GraphModule(torch.nn.Module(), graph)
    lowered, count = accumulate_in_place(module)
    assert count == 0
    args = (torch.randn(3, 4), torch.randn(3, 5).bfloat16(), torch.randn(5, 4).bfloat16())
    for want, got in zip(module(*[x.clone() for x in args]), lowered(*[x.clone() for x in args])):
        assert torch.equal(want, got)
