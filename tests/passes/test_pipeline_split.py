"""The stage split (passes/pipeline.py) and the schedule lowered into one program per stage
(passes/lower_schedule.py), run on the SPMD simulator, equal eager PyTorch and the program they
were cut from."""

import copy

import pytest
import torch
from hypothesis import given, strategies as st

import fxshard
from fxshard import meta, schedule as schedules
from fxshard.api import _compile
from fxshard.models import GPT, GPTConfig, MoEGPT, MoEGPTConfig
from fxshard.passes import run_pipeline
from fxshard.passes.lower_schedule import lower_schedule
from fxshard.passes.pipeline import assign_layers, chunk_costs, layer_costs, split_stages
from fxshard.program import STAGE_LOCAL, InputKind, OutputKind
from fxshard.testing import SimulatedRanks, assert_step_like_eager, relative, torch_optimizer, traced_once


def model_loss(model, batch):
    return model.loss(batch)


def token_microbatches(vocab, count, rows=2, seq=8, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [{"idx": torch.randint(0, vocab, (rows, seq), generator=generator),
             "tgt": torch.randint(0, vocab, (rows, seq), generator=generator)} for _ in range(count)]


def concatenated(microbatches):
    return {key: torch.cat([mb[key] for mb in microbatches]) for key in microbatches[0]}


def unsplit_program_run(program, params, batch):
    """The un-rewritten program on one microbatch: (loss, {param: gradient}), and the buffers it
    updates written back into `params`. Traced with plain SGD at lr 1, so each gradient is the
    parameter minus its update."""
    args = []
    leaves = iter(torch.utils._pytree.tree_leaves(batch))
    for spec in program.inputs:
        if spec.kind is InputKind.BATCH:
            args.append(next(leaves))
        elif spec.kind in (InputKind.LR, InputKind.STEP):
            args.append(torch.tensor(1.0))
        else:
            args.append(params[spec.name])
    outputs = dict(zip([(o.kind, o.name) for o in program.outputs], program.graph_module(*args)))
    grads = {name: params[name] - value for (kind, name), value in outputs.items() if kind is OutputKind.PARAM}
    params.update({name: value for (kind, name), value in outputs.items() if kind is OutputKind.BUFFER})
    return outputs[OutputKind.LOSS, "loss"], grads


def check_pipeline(model, loss_fn, microbatches, schedule, stage_layers=None, receives="early", layers=None):
    """One SGD step (lr 1) of the lowered stage programs on the simulator: the loss is eager's mean
    over microbatches, each gradient (parameter minus update) eager's, and the sum of the gradients
    of the un-split program run on each microbatch. `layers`: Config(layers)."""
    program = fxshard.trace(model, loss_fn, microbatches[0], optimizer=fxshard.optim.SGD(lr=1.0),
                            config=fxshard.Config(layers=layers))
    pipeline = split_stages(program, schedule.chunks, stage_layers)
    stages = [lower_schedule(pipeline, schedule, stage, receives=receives) for stage in range(schedule.stages)]
    ranks = SimulatedRanks(stages, model, fxshard.optim.SGD(lr=1.0), fxshard.Mesh(pp=schedule.stages))
    metrics = ranks.step([concatenated(microbatches)] * schedule.stages)
    updated = ranks.parameters()
    params = {name: p.detach() for name, p in model.named_parameters()}
    reference = copy.deepcopy(model)
    ref_losses = [loss_fn(reference, mb) for mb in microbatches]
    ref_loss = sum(ref_losses) / len(microbatches)
    ref_loss.backward()
    for stage_metrics in metrics:  # every stage reports the loss
        assert abs(stage_metrics["loss"].item() - ref_loss.item()) <= 1e-5 * abs(ref_loss.item())
    for name, p in reference.named_parameters():
        if p.requires_grad:
            scale = max(p.grad.abs().max().item(), 1e-6)
            tolerance = 1e-5 * scale + 1e-6 * params[name].abs().max().item()  # param - update rounds
            assert (params[name] - updated[name] - p.grad).abs().max().item() <= tolerance, name
    # and against the program the split was cut from, microbatch by microbatch (buffers carried over)
    params.update({name: b.clone() for name, b in model.named_buffers()})
    unsplit = [unsplit_program_run(program, params, mb) for mb in microbatches]
    assert abs(metrics[0]["loss"].item() - sum(loss.item() for loss, _ in unsplit) / len(unsplit)) <= \
        1e-5 * abs(ref_loss.item())
    for name in unsplit[0][1]:
        total = sum(g[name] for _, g in unsplit) / len(unsplit)
        tolerance = 1e-5 * total.abs().max().item() + 2e-6 * params[name].abs().max().item()
        assert (params[name] - updated[name] - total).abs().max().item() <= tolerance, name
    return pipeline, stages


@given(layers=st.integers(1, 4), stages=st.integers(1, 3), virtual=st.integers(1, 2), rounds=st.integers(1, 2),
       kind=st.sampled_from(["gpipe", "1f1b", "interleaved", "zb-h1", "dualpipev"]),
       receives=st.sampled_from(["early", "late"]), data=st.data())
def test_every_schedule_over_the_split_computes_eager_losses_and_gradients(layers, stages, virtual, rounds,
                                                                          kind, receives, data):
    if kind in ("1f1b", "zb-h1"):
        virtual = 1
    if kind == "dualpipev":  # two chunks per rank, in a V
        layers, virtual = max(layers, 2), 2
    if stages * virtual > layers:
        virtual = 2 if kind == "dualpipev" else 1
        stages = data.draw(st.integers(1, layers // virtual), label="stages")
    microbatches = 2 * stages - 2 + rounds if kind == "dualpipev" else stages * rounds
    schedule = {"gpipe": lambda: schedules.gpipe(stages, microbatches, virtual),
                "1f1b": lambda: schedules.one_f_one_b(stages, microbatches),
                "interleaved": lambda: schedules.interleaved_one_f_one_b(stages, microbatches, virtual),
                "zb-h1": lambda: schedules.zero_bubble_h1(stages, microbatches),
                "dualpipev": lambda: schedules.dualpipe_v(stages, microbatches)}[kind]()
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=24, d_model=16, n_layer=layers, n_head=2, d_ff=24))
    check_pipeline(model, model_loss, token_microbatches(24, microbatches), schedule, receives=receives)


def test_a_cut_between_a_blocks_attention_and_its_mlp():
    """Config(layers=attention and MLP of each block): chunks may end inside a block (the residual
    stream crosses between stages there). Each chunk here holds one half-block."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=24, d_model=16, n_layer=2, n_head=2, d_ff=24))
    pipeline, _ = check_pipeline(model, model_loss, token_microbatches(24, 4),
                                 schedules.interleaved_one_f_one_b(2, 4, 2), stage_layers=(1, 1, 1, 1),
                                 layers=("layers.*.attn", "layers.*.mlp"))
    assert [chunk.layers for chunk in pipeline.chunks] == [
        ("pre", "layers.0.attn"), ("layers.0.mlp",), ("layers.1.attn",), ("layers.1.mlp", "post")]


def test_moe_gpt_over_four_chunks():
    torch.manual_seed(0)
    model = MoEGPT(MoEGPTConfig.preset("tiny", n_layer=4))
    check_pipeline(model, model_loss, token_microbatches(64, 4), schedules.interleaved_one_f_one_b(2, 4, 2))


def test_tied_embedding_gets_a_partial_gradient_on_the_first_and_the_last_chunk():
    from test_foreign_models import GPT2

    torch.manual_seed(0)
    model = GPT2(layers=2)
    pipeline, stages = check_pipeline(model, lambda m, b: m(b["idx"], b["tgt"]), token_microbatches(40, 2),
                                      schedules.one_f_one_b(2, 2))
    first, last = pipeline.chunks[0], pipeline.chunks[-1]
    assert "wte.weight" in first.grads and "wte.weight" in last.grads
    assert "wte.weight" in first.params and "wte.weight" in last.params
    assert "wpe.weight" not in first.grads  # frozen
    # summed over both stages by a graph collective, counted in the gradient norm on the first only
    for program in stages:
        reduces = [n for n in program.graph.nodes if n.target is torch.ops._c10d_functional.all_reduce.default
                   and n.args[2] == "pp" and meta.phase(n) == meta.BWD]
        assert len(reduces) == 1 and reduces[0].meta["val"].shape == model.wte.weight.shape
    assert [u.name for u in stages[1].updates if not u.counted] == ["wte.weight"]
    assert all(u.counted for u in stages[0].updates)


class TwiceTied(torch.nn.Module):
    """An embedding read twice before the blocks (T5's shared embedding feeds encoder and decoder)
    and tied to the head: its gradient sums add(add(head, one read), other read)."""

    def __init__(self, vocab=40, d=16):
        super().__init__()
        self.emb, self.norm = torch.nn.Embedding(vocab, d), torch.nn.LayerNorm(d)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(d, d) for _ in range(2))
        self.head = torch.nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx, ctx):
        x = self.emb(idx) + self.emb(ctx).mean(1, keepdim=True)
        for block in self.blocks:
            x = x + torch.tanh(block(x))
        return self.head(self.norm(x))


def test_a_tied_embedding_read_twice_in_the_first_chunk_gets_its_partial_gradients():
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    microbatches = [{"idx": torch.randint(0, 40, (2, 8), generator=generator),
                     "ctx": torch.randint(0, 40, (2, 3), generator=generator),
                     "tgt": torch.randint(0, 40, (2, 8), generator=generator)} for _ in range(2)]
    loss = lambda m, b: torch.nn.functional.cross_entropy(m(b["idx"], b["ctx"]).flatten(0, 1), b["tgt"].flatten())
    pipeline, _ = check_pipeline(TwiceTied(), loss, microbatches, schedules.one_f_one_b(2, 2))
    assert "emb.weight" in pipeline.chunks[0].grads and "emb.weight" in pipeline.chunks[-1].grads


def test_dualpipev_keeps_the_tied_embedding_and_head_on_rank_0_with_no_all_reduce():
    """V placement: chunk 0 (embedding) and chunk 2P-1 (head, loss) both run on stage 0, so the tied
    weight's two partial gradients add up there and no stage pair exchanges it."""
    from test_foreign_models import GPT2

    torch.manual_seed(0)
    model = GPT2(layers=4)
    pipeline, stages = check_pipeline(model, lambda m, b: m(b["idx"], b["tgt"]), token_microbatches(40, 3),
                                      schedules.dualpipe_v(2, 3))
    assert "wte.weight" in pipeline.chunks[0].grads and "wte.weight" in pipeline.chunks[3].grads
    assert "wte.weight" in stages[0].stage.params_by_stage[0] and "wte.weight" not in stages[1].stage.params_by_stage[1]
    for program in stages:
        assert not [n for n in program.graph.nodes if n.target is torch.ops._c10d_functional.all_reduce.default
                    and meta.phase(n) == meta.BWD]
        assert all(u.counted for u in program.updates) and not program.stage.groups
    assert "chunks [0, 3]" in stages[0].notes["pipeline"] and "chunks [1, 2]" in stages[1].notes["pipeline"]


def test_layers_are_balanced_by_cost_or_set_by_stage_layers():
    layers = [f"layers.{i}" for i in range(5)]
    costs = {"layers.0": 100, "layers.1": 100, "layers.2": 100, "layers.3": 100, "layers.4": 400}
    assert assign_layers(layers, 2, costs) == [["pre", *layers[:4]], ["layers.4", "post"]]
    assert assign_layers(layers, 2, costs, [2, 3]) == [["pre", *layers[:2]], [*layers[2:], "post"]]
    # the head (post) counts in the last chunk: with it, 3 + 2 blocks is the even cut, not 2 + 3
    even = {layer: 100 for layer in layers}
    assert assign_layers(layers, 2, even) == [["pre", *layers[:2]], [*layers[2:], "post"]]
    assert assign_layers(layers, 2, {**even, "post": 150}) == [["pre", *layers[:3]], [*layers[3:], "post"]]
    with pytest.raises(fxshard.FxShardError, match="only 5 layers"):
        assign_layers(layers, 6, costs)
    with pytest.raises(fxshard.FxShardError, match="stage_layers"):
        assign_layers(layers, 2, costs, [1, 1])
    with pytest.raises(fxshard.FxShardError, match="stage_layers must list ints"):  # sums to 4, cuts nowhere
        fxshard.Config(stage_layers=(1.5, 2.5))


@given(st.lists(st.integers(1, 9), min_size=1, max_size=7), st.integers(1, 4), st.integers(0, 9), st.integers(0, 9))
def test_the_balanced_cut_makes_the_costliest_chunk_as_cheap_as_any_cut_can(weights, chunks, pre, post):
    """Against every contiguous cut (brute force): no cut has a cheaper costliest chunk."""
    import itertools

    chunks = min(chunks, len(weights))
    layers = [f"layers.{i}" for i in range(len(weights))]
    costs = {**dict(zip(layers, weights)), "pre": pre, "post": post}

    def costliest(groups):
        return max(sum(costs[layer] for layer in group) for group in groups)

    best = min(costliest(assign_layers(layers, chunks, costs, [b - a for a, b in zip((0, *cuts), (*cuts, len(layers)))]))
               for cuts in itertools.combinations(range(1, len(layers)), chunks - 1))
    groups = assign_layers(layers, chunks, costs)
    assert [layer for group in groups for layer in group] == ["pre", *layers, "post"]
    assert costliest(groups) == best


def test_chunks_are_cut_and_timed_by_their_flops():
    """GPT with a head as costly as two blocks: the last chunk takes fewer blocks, and the simulator
    times each chunk's actions by its FLOPs (the dump says so)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=320, d_model=16, n_layer=6, n_head=2, d_ff=24))
    program = fxshard.trace(model, model_loss, token_microbatches(320, 1)[0], optimizer=fxshard.optim.SGD(lr=1.0))
    costs = layer_costs(program)
    assert 1.9 < costs["post"] / costs["layers.0"] < 2.3 and costs["layers.0"] == costs["layers.5"]
    pipeline = split_stages(program, 2)
    assert [len(c.layers) for c in pipeline.chunks] == [1 + 4, 2 + 1]  # pre + 4 blocks | 2 blocks + post
    schedule = schedules.one_f_one_b(2, 4)
    timed = chunk_costs(pipeline, schedule)
    assert timed["F0"] + timed["F1"] == pytest.approx(2.0) and abs(timed["F1"] / timed["F0"] - 1) < 0.1
    assert timed["B0"] > timed["F0"] and "W0" not in timed
    split = chunk_costs(pipeline, schedules.zero_bubble_h1(2, 4))
    assert split["B0"] + split["W0"] == pytest.approx(timed["B0"])  # the backward's FLOPs, divided
    stage = lower_schedule(pipeline, schedule, 1)
    assert dict(stage.stage.costs) == timed


def test_zero_bubble_runs_the_weight_gradients_split_off_the_backward():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=24, d_model=16, n_layer=3, n_head=2, d_ff=24))
    pipeline, _ = check_pipeline(model, model_loss, token_microbatches(24, 3), schedules.zero_bubble_h1(3, 3))
    middle = pipeline.chunks[1]
    assert middle.carry and len(middle.backward_weight.graph.nodes) > 0


class ScaledBlock(torch.nn.Module):
    """Reads a tensor constant made in its forward (a get_attr in the traced graph, like the cache
    objects of Hugging Face decoders)."""

    def __init__(self, width):
        super().__init__()
        self.linear = torch.nn.Linear(width, width)

    def forward(self, x):
        return torch.tanh(self.linear(x)) * torch.tensor([0.5, 2.0]).repeat(x.shape[-1] // 2)


class Blocks(torch.nn.Module):
    """`layers` blocks made by `block(width)`, applied in order (the layers the split cuts between)."""

    def __init__(self, block, width, layers):
        super().__init__()
        self.layers = torch.nn.ModuleList(block(width) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.mark.parametrize("kind", ["1f1b", "zb-h1"])
def test_constants_are_copied_into_every_chunk_that_reads_them(kind):
    torch.manual_seed(0)
    model = Blocks(ScaledBlock, 8, 3)
    generator = torch.Generator().manual_seed(0)
    microbatches = [{"x": torch.randn(2, 8, generator=generator), "y": torch.randn(2, 8, generator=generator)}
                    for _ in range(3)]
    schedule = schedules.one_f_one_b(3, 3) if kind == "1f1b" else schedules.zero_bubble_h1(3, 3)
    pipeline, _ = check_pipeline(model, lambda m, b: ((m(b["x"]) - b["y"]) ** 2).mean(), microbatches, schedule)
    for chunk in pipeline.chunks:
        assert any(n.op == "get_attr" for n in chunk.forward.graph.nodes), chunk.index


@pytest.mark.parametrize("kind", ["1f1b", "dualpipev"])
def test_a_metric_that_reads_no_input_is_summed_over_microbatches_like_the_others(kind):
    """A constant metric (a microbatch count) is input-free compute, which the split copies into the
    chunks that read it: it was in no chunk, so every stage reported 0 for it."""
    torch.manual_seed(0)
    model = Blocks(ScaledBlock, 8, 4)
    generator = torch.Generator().manual_seed(0)
    microbatches = [{"x": torch.randn(2, 8, generator=generator), "y": torch.randn(2, 8, generator=generator)}
                    for _ in range(4)]

    def loss_fn(m, b):
        return ((m(b["x"]) - b["y"]) ** 2).mean(), {"microbatches": torch.ones(()), "rows": (b["y"] == b["y"]).sum()}

    program = fxshard.trace(model, loss_fn, microbatches[0], optimizer=fxshard.optim.SGD(lr=1.0))
    schedule = schedules.build(kind, 2, 4, 2 if kind == "dualpipev" else 1)
    pipeline = split_stages(program, schedule.chunks)
    stages = [lower_schedule(pipeline, schedule, stage) for stage in range(2)]
    ranks = SimulatedRanks(stages, model, fxshard.optim.SGD(lr=1.0), fxshard.Mesh(pp=2))
    for metrics in ranks.step([concatenated(microbatches)] * 2):
        assert metrics["microbatches"].item() == 4 and metrics["rows"].item() == 4 * 2 * 8


@given(strategy=st.sampled_from(["no_shard", "optim", "optim_grads", "optim_grads_params"]),
       kind=st.sampled_from(["1f1b", "interleaved-1f1b", "zb-h1", "gpipe", "dualpipev"]), tied=st.booleans())
def test_fsdp_over_dp_inside_the_pipeline_trains_like_one_device(strategy, kind, tied):
    """Mesh(pp=2, dp=2): the pass list (pipeline, then fsdp on each stage's program) on the simulator,
    two AdamW steps against eager PyTorch on the global batch."""
    from test_foreign_models import GPT2

    torch.manual_seed(0)
    if tied:
        model, loss_fn = GPT2(vocab=40, layers=4), lambda m, b: m(b["idx"], b["tgt"])
        optimizer = fxshard.optim.SGD(lr=0.05, momentum=0.9)  # GPT2's key bias: see test_parity_pipeline_gloo
    else:
        model, loss_fn = GPT(GPTConfig(vocab_size=40, d_model=16, n_layer=4, n_head=2, d_ff=24)), model_loss
        optimizer = fxshard.optim.AdamW(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    mesh, microbatches = fxshard.Mesh(pp=2, dp=2), 4
    config = fxshard.Config(schedule=kind, virtual_stages=2 if kind == "interleaved-1f1b" else 1,
                            microbatches=microbatches, sharding=strategy)
    steps = [token_microbatches(40, 2 * microbatches, seed=seed) for seed in range(2)]
    stages = assert_trains_like_eager(model, loss_fn, optimizer, mesh, config, steps, key=("fsdp_inside_pp", tied))
    sharded = {spec.placement.kind for p in stages for spec in p.inputs_of(InputKind.PARAM) if spec.requires_grad}
    assert sharded == ({"sharded"} if strategy == "optim_grads_params" else {"replicated"}), sharded


def test_a_stage_whose_parameters_are_all_frozen_trains_under_every_strategy():
    """Fine-tuning the top: the first stage (embedding, layers.0) trains nothing, so ZeRO has no unit there."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=40, d_model=16, n_layer=2, n_head=2, d_ff=24))
    for name, p in model.named_parameters():
        p.requires_grad_(not name.startswith(("tok_emb", "layers.0.")))
    optimizer = fxshard.optim.AdamW(lr=1e-2)
    steps = [token_microbatches(40, 4, seed=seed) for seed in range(2)]
    for strategy in ("optim", "optim_grads"):  # the ones whose pass gathers updates (a StopIteration once)
        config = fxshard.Config(microbatches=2, stage_layers=(1, 1), sharding=strategy)
        assert_trains_like_eager(copy.deepcopy(model), model_loss, optimizer, fxshard.Mesh(pp=2, dp=2), config, steps)


def assert_trains_like_eager(model, loss_fn, optimizer, mesh, config, steps, key=None):
    """The pass list for every stage on the simulator, one step per entry of `steps` (each rank of dp
    coordinate d gets the d-th half of the step's microbatches), against eager PyTorch on the global
    batch; returns the stage programs. With `key`, the trace is shared with other calls of that key
    (fxshard.testing.traced_once)."""
    microbatches = config.microbatches
    trace = lambda: fxshard.trace(model, loss_fn, steps[0][0], optimizer=optimizer)  # noqa: E731
    program = trace() if key is None else traced_once(key, trace)
    stages = [run_pipeline(program, mesh, config, stage=stage)[-1] for stage in range(mesh.pp)]
    ranks = SimulatedRanks(stages, model, optimizer, mesh)
    reference = copy.deepcopy(model)
    torch_opt = torch_optimizer(optimizer, reference.named_parameters())
    for pieces in steps:
        local = [concatenated(pieces[:microbatches]), concatenated(pieces[microbatches:])]
        metrics = ranks.step([local[mesh.coords(rank)["dp"]] for rank in range(mesh.size)])
        torch_opt.zero_grad()
        loss = sum(loss_fn(reference, mb) for mb in pieces) / len(pieces)
        loss.backward()
        torch_opt.step()
        for rank_metrics in metrics:
            assert abs(rank_metrics["loss"].item() - loss.item()) <= 1e-5 * abs(loss.item())
    params = ranks.parameters(rank=mesh.size - 1)
    for name, p in reference.named_parameters():
        assert relative(params[name], p) < 1e-4, name
    return stages


def test_interleaved_1f1b_over_three_stages_runs_on_the_simulator():
    """Each stage's first action receives from the stage before it (rank 0's from the last): receives
    pause a rank where they are waited for, not where they are issued, or this reads as a deadlock."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=24, d_model=16, n_layer=6, n_head=2, d_ff=24))
    check_pipeline(model, model_loss, token_microbatches(24, 3), schedules.interleaved_one_f_one_b(3, 3, 2))


def test_the_lowered_program_issues_receives_early_and_waits_where_the_value_is_read():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=24, d_model=16, n_layer=2, n_head=2, d_ff=24))
    program = fxshard.trace(model, model_loss, token_microbatches(24, 1)[0])
    schedule = schedules.one_f_one_b(2, 4)
    last = lower_schedule(split_stages(program, 2), schedule, 1, receives="early")
    nodes = list(last.graph.nodes)
    recvs = [n for n in nodes if n.target is torch.ops.fxshard.recv.default]
    sends = [n for n in nodes if n.target is torch.ops.fxshard.send.default]
    assert len(recvs) == len(sends) == 4 * len(split_stages(program, 2).chunks[0].send)
    # issue_order: microbatches 0 and 1 are both received before the first forward runs
    first_compute = next(n for n in nodes if meta.phase(n) == meta.FWD and n.op == "call_function"
                         and n.target not in (torch.ops.fxshard.recv.default, torch.ops._c10d_functional.wait_tensor.default)
                         and meta.layer(n) != meta.PRE)
    assert sum(nodes.index(r) < nodes.index(first_compute) for r in recvs) == 2 * len(recvs) // 4
    for recv in recvs:  # each receive is read through one wait
        (wait,) = recv.users
        assert wait.target is torch.ops._c10d_functional.wait_tensor.default
    assert {meta.microbatch(n) for n in nodes if meta.phase(n) == meta.BWD} == {0, 1, 2, 3}
    assert last.stage.stage == 1 and {u.norm_axes for u in last.updates} == {("pp",)}
    # the backward starts from d(mean loss)/d(microbatch loss) = 1/4: no pass divides the gradients after
    (tangent,) = [n for n in nodes if n.meta.get(meta.LOSS_TANGENT)]
    assert tangent.args[1] == 1 / 4 and not any(n.target is torch.ops.aten.mul.Tensor and n.args[1] == 1 / 4
                                                 and meta.phase(n) == meta.BWD for n in nodes)
    # Config(p2p_receives="late"): only microbatch 0's before the first forward, each receive issued
    # right before the compute that reads it
    late = list(lower_schedule(split_stages(program, 2), schedule, 1, receives="late").graph.nodes)
    late_recvs = [n for n in late if n.target is torch.ops.fxshard.recv.default]
    first_compute = next(n for n in late if meta.phase(n) == meta.FWD and n.op == "call_function"
                         and n.target not in (torch.ops.fxshard.recv.default, torch.ops._c10d_functional.wait_tensor.default)
                         and meta.layer(n) != meta.PRE)
    assert sum(late.index(r) < late.index(first_compute) for r in late_recvs) == len(late_recvs) // 4
    early_gaps = [nodes.index(next(iter(r.users))) - nodes.index(r) for r in recvs]
    late_gaps = [late.index(next(iter(r.users))) - late.index(r) for r in late_recvs]
    assert sum(late_gaps) < sum(early_gaps)  # fewer nodes issued while a receive is posted


def test_a_chunks_parameter_casts_run_ahead_of_the_wait_for_its_first_input():
    """The once-a-step casts to param_dtype read nothing received: they come before the wait of the
    chunk's first forward, so they run while its input is in transit, not after it arrives."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=24, d_model=16, n_layer=4, n_head=2, d_ff=24))
    program = fxshard.trace(model, model_loss, token_microbatches(24, 1)[0],
                            config=fxshard.Config(param_dtype=torch.bfloat16))
    schedule = schedules.interleaved_one_f_one_b(2, 4, 2)
    for receives in ("early", "late"):
        nodes = list(lower_schedule(split_stages(program, 4), schedule, 1, receives=receives).graph.nodes)
        for chunk in (1, 3):
            first = [n for n in nodes if n.meta.get(meta.ACTION) == f"F{chunk}:0"]
            casts = [n for n in first if n.target is torch.ops.aten._to_copy.default
                     and n.args[0].op == "placeholder"]
            wait = next(n for n in first if n.target is torch.ops._c10d_functional.wait_tensor.default)
            assert casts and all(nodes.index(cast) < nodes.index(wait) for cast in casts), (receives, chunk)


@given(strategy=st.sampled_from(["no_shard", "optim", "optim_grads_params"]),
       kind=st.sampled_from(["1f1b", "zb-h1", "gpipe"]), overlap=st.booleans())
def test_expert_parallel_inside_the_pipeline_trains_like_one_device(strategy, kind, overlap):
    """Mesh(pp=2, dp=2, ep=2): the ep pass rewrites the microbatch program, the pipeline pass cuts and
    schedules it, fsdp shards experts over edp and the rest over dp; SGD so parameters compare tightly."""
    torch.manual_seed(0)
    model = MoEGPT(MoEGPTConfig.preset("tiny", n_layer=2))
    optimizer = fxshard.optim.SGD(lr=0.05, momentum=0.9)
    mesh, microbatches = fxshard.Mesh(pp=2, dp=2, ep=2), 2
    config = fxshard.Config(schedule=kind, microbatches=microbatches, sharding=strategy, ep_overlap=overlap)
    pieces = token_microbatches(64, 2 * microbatches, seq=16)
    program = traced_once("ep_inside_pp", lambda: fxshard.trace(model, model_loss, pieces[0], optimizer=optimizer))
    stages = [run_pipeline(program, mesh, config, stage=stage) for stage in range(mesh.pp)]
    assert [p.name for p in stages[0]][:4] == ["traced", "recognize_moe", "ep", "pipeline"]
    for programs in stages:  # fsdp and overlap keep the transfer order lower_schedule chose
        transfers = [[(n.target, n.args[-2], str(n.meta["val"].shape)) for n in p.graph.nodes
                      if n.op == "call_function" and n.target in (torch.ops.fxshard.send.default,
                                                                  torch.ops.fxshard.recv.default)]
                     for p in programs[3:]]
        assert transfers[0] and all(t == transfers[0] for t in transfers)
    local = [concatenated(pieces[:microbatches]), concatenated(pieces[microbatches:])]
    assert_step_like_eager([s[-1] for s in stages], model, optimizer, mesh,
                           [local[mesh.coords(rank)["dp"]] for rank in range(mesh.size)], pieces, model_loss)


class _EmaLayer(torch.nn.Module):
    """Reads a buffer in its forward and then updates it in place (as BatchNorm's statistics or a
    router's token counts): microbatch m+1's forward sees m's update, and each backward needs the
    value its own forward read (tanh's derivative at lin(x) + ema)."""

    def __init__(self, width):
        super().__init__()
        self.lin = torch.nn.Linear(width, width)
        self.register_buffer("ema", torch.zeros(width))

    def forward(self, x):
        y = torch.tanh(self.lin(x) + self.ema)
        self.ema.mul_(0.5).add_(y.detach().mean(0))
        return y


class _EmaRebinding(_EmaLayer):
    """The same update by rebinding the attribute (`self.ema = ...`), which eager allows: the tracer
    writes the new value back into the buffer, in the layer that owns it (it was the head's layer, so
    the split refused it as a buffer shared between chunks)."""

    def forward(self, x):
        y = torch.tanh(self.lin(x) + self.ema)
        self.ema = self.ema * 0.5 + y.detach().mean(0)
        return y


@given(kind=st.sampled_from(["gpipe", "1f1b", "interleaved", "zb-h1"]), rounds=st.integers(1, 2),
       seed=st.integers(0, 3), layer=st.sampled_from([_EmaLayer, _EmaRebinding]))
def test_buffers_updated_in_the_forward_thread_through_the_microbatches_of_every_stage(kind, rounds, seed, layer):
    """Each stage's buffers after the step are eager's after running the microbatches in order (and
    every stage program returns those it holds); losses and gradients match eager's."""
    stages, virtual = 2, 2 if kind == "interleaved" else 1
    microbatches = stages * rounds
    schedule = {"gpipe": lambda: schedules.gpipe(stages, microbatches),
                "1f1b": lambda: schedules.one_f_one_b(stages, microbatches),
                "interleaved": lambda: schedules.interleaved_one_f_one_b(stages, microbatches, virtual),
                "zb-h1": lambda: schedules.zero_bubble_h1(stages, microbatches)}[kind]()
    torch.manual_seed(seed)
    model = Blocks(layer, 6, 4)
    batches = [{"x": torch.randn(3, 6), "y": torch.randn(3, 6)} for _ in range(microbatches)]

    def loss_fn(m, b):
        return torch.nn.functional.mse_loss(m(b["x"]), b["y"])

    reference = copy.deepcopy(model)
    pipeline, stage_programs = check_pipeline(model, loss_fn, batches, schedule)
    assert sum(len(c.buffers) for c in pipeline.chunks) == 4
    with torch.no_grad():
        for batch in batches:
            reference(batch["x"])
    ranks = SimulatedRanks(stage_programs, model, fxshard.optim.SGD(lr=1.0), fxshard.Mesh(pp=stages))
    ranks.step([concatenated(batches)] * stages)
    held = {}
    for stage, state in enumerate(ranks.states):
        outputs = stage_programs[stage].outputs_of(OutputKind.BUFFER)
        assert outputs and all(o.placement == STAGE_LOCAL for o in outputs)
        held.update({o.name: state[InputKind.BUFFER, o.name] for o in outputs})
    expected = dict(reference.named_buffers())
    assert held.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(held[name], value, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("strategy", ["no_shard", "optim"])
def test_a_stage_without_experts_joins_the_expert_gradient_norm_all_reduce(strategy):
    """DeepSeek-V3 style: the first layer is dense, so under Mesh(pp=2, dp=2, ep=2) stage 0 holds no
    expert units. With replicated units the experts' squared norm sums over `ep`; stage 0 must issue
    that all-reduce too (the pp group's members issue the same collectives), and every rank reports
    eager's gradient norm."""
    from model_zoo import MODELS, build, masked_batches, rows_of

    name, mesh = "titan_deepseek_v3", fxshard.Mesh(pp=2, dp=2, ep=2)
    config = fxshard.Config(schedule="1f1b", microbatches=2, sharding=strategy, stage_layers=(1, 2))
    optimizer = fxshard.optim.AdamW(lr=1e-3)
    model, loss_fn = build(name), MODELS[name][1]
    batch = masked_batches(name, 1, 4)[0]
    program = fxshard.trace(model, loss_fn, rows_of(batch, 0, 1), optimizer=optimizer, balance=False)
    stages = [run_pipeline(program, mesh, config, stage=s)[-1] for s in range(2)]
    optim_reduces = [[n.args[2] for n in p.graph.nodes if meta.phase(n) == meta.OPTIM
                      and n.target is torch.ops._c10d_functional.all_reduce.default] for p in stages]
    assert optim_reduces[0] == optim_reduces[1]
    assert not any(u.name.endswith(":experts") for u in stages[0].updates)
    ranks = SimulatedRanks(stages, model, optimizer, mesh)
    local = [rows_of(batch, 0, 2), rows_of(batch, 2, 4)]
    metrics = ranks.step([local[mesh.coords(r)["dp"]] for r in range(mesh.size)])
    reference = copy.deepcopy(model)
    (sum(loss_fn(reference, rows_of(batch, i, i + 1)) for i in range(4)) / 4).backward()
    norm = torch.sqrt(sum(p.grad.float().square().sum() for p in reference.parameters() if p.grad is not None))
    for rank_metrics in metrics:
        assert relative(rank_metrics["grad_norm"], norm) < 1e-5


def test_a_buffer_updated_in_one_chunk_and_read_in_another_is_refused():
    """A model-level buffer that layer 0 reads and layer 1 updates: across a cut, the two chunks would
    read different values, so the split refuses it and names the buffer and the layers."""

    class Layer(torch.nn.Module):
        def __init__(self, width, updates):
            super().__init__()
            self.lin, self.updates = torch.nn.Linear(width, width), updates

        def forward(self, x, shared):
            y = torch.tanh(self.lin(x) + shared)
            if self.updates:
                shared.mul_(0.5).add_(y.detach().mean(0))
            return y

    class Shared(torch.nn.Module):
        def __init__(self, width=6):
            super().__init__()
            self.layers = torch.nn.ModuleList([Layer(width, False), Layer(width, True)])
            self.register_buffer("shared", torch.zeros(width))

        def forward(self, x):
            for layer in self.layers:
                x = layer(x, self.shared)
            return x

    batch = {"x": torch.randn(3, 6), "y": torch.randn(3, 6)}
    program = fxshard.trace(Shared(), lambda m, b: torch.nn.functional.mse_loss(m(b["x"]), b["y"]), batch)
    with pytest.raises(fxshard.FxShardError, match=r"buffer 'shared' is updated .* read by layers .*stage_layers"):
        split_stages(program, 2)
    assert len(split_stages(program, 1).chunks) == 1  # one chunk holds both: nothing to refuse


def test_a_schedule_running_forwards_out_of_order_is_refused_where_the_chunk_updates_buffers():
    torch.manual_seed(0)
    model = Blocks(_EmaLayer, 6, 2)
    batch = {"x": torch.randn(3, 6), "y": torch.randn(3, 6)}
    program = fxshard.trace(model, lambda m, b: torch.nn.functional.mse_loss(m(b["x"]), b["y"]), batch)
    pipeline = split_stages(program, 2)
    ordered = schedules.gpipe(2, 2)
    swapped = [list(actions) for actions in ordered.ranks]
    first, second = (i for i, a in enumerate(swapped[0]) if a.kind == "F")
    swapped[0][first], swapped[0][second] = swapped[0][second], swapped[0][first]
    compute = [[a for a in actions if a.kind in schedules.COMPUTE] for actions in swapped]
    reordered = schedules.add_communication(compute, 2, 1, 2, "swapped")
    lower_schedule(pipeline, ordered, 0)
    with pytest.raises(fxshard.FxShardError, match=r"chunk 0's forwards in microbatch order \[1, 0\]"):
        lower_schedule(pipeline, reordered, 0)


class _WithLinearTerm(GPT):
    """A parameter whose gradient reads no input (the loss is linear in it): lower_schedule computes
    it once a step, in the first action that needs it, and later actions accumulate that node."""

    def __init__(self):
        super().__init__(GPTConfig(vocab_size=24, d_model=16, n_layer=4, n_head=2, d_ff=24))
        self.z = torch.nn.Parameter(torch.zeros(4))


def test_each_actions_nodes_stay_together_where_a_gradient_is_made_once_a_step():
    """The accumulation of a gradient an earlier action made is not placed among that action's nodes
    (only a gradient the current action made gets its add right after it): the stage's actions stay in
    order, which the fsdp pass under dp > 1 requires (it raised on the out-of-order nodes)."""
    from fxshard.api import _compile

    torch.manual_seed(0)
    batch = {"idx": torch.randint(0, 24, (6, 8)), "tgt": torch.randint(0, 24, (6, 8))}
    programs = _compile(_WithLinearTerm(), lambda m, b: m.loss(b) + 0.01 * m.z.sum(), batch,
                        fxshard.optim.AdamW(lr=1e-3), fxshard.Mesh(pp=2, dp=2),
                        fxshard.Config(microbatches=3, schedule="1f1b"), (1,))
    indices = [meta.action_index(n) for n in programs[-1].graph.nodes if meta.action_index(n) is not None]
    assert indices == sorted(indices) and len(set(indices)) > 3


def test_a_stages_flat_gradients_are_laid_out_after_its_last_send():
    """With nothing to reduce (dp = 1), the fsdp pass lays a unit's gradient out flat where the
    optimizer phase starts: a chunk's last backward sends its input gradient on without waiting for
    its layers' flattening (each a memory pass over the layer's gradients)."""
    from fxshard.api import _compile

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=24, d_model=16, n_layer=4, n_head=2, d_ff=24))
    batch = {"idx": torch.randint(0, 24, (4, 8)), "tgt": torch.randint(0, 24, (4, 8))}
    config = fxshard.Config(microbatches=4, schedule="interleaved-1f1b", virtual_stages=2)
    programs = _compile(model, model_loss, batch, fxshard.optim.AdamW(lr=1e-3), fxshard.Mesh(pp=2), config, (0,))
    nodes = list(programs[-1].graph.nodes)
    flats = [i for i, n in enumerate(nodes) if n.target is torch.ops.aten.cat.default and meta.MICROBATCH not in n.meta]
    sends = [i for i, n in enumerate(nodes) if n.target is torch.ops.fxshard.send.default]
    assert len(flats) >= 2 and sends and min(flats) > max(sends)


class TiedHead(torch.nn.Module):
    """An embedding tied to the head, as `nn.Linear(bias=False)` sharing its weight."""

    def __init__(self, vocab=40, width=16, blocks=4):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, width)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(blocks))
        self.head = torch.nn.Linear(width, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx):
        x = self.emb(idx)
        for block in self.blocks:
            x = x + torch.tanh(block(x))
        return self.head(x)


@pytest.mark.parametrize("kind", ["1f1b", "dualpipev"])
def test_a_tied_weight_under_param_dtype_is_cast_by_each_chunk_that_reads_it(kind):
    """Config(param_dtype): the tied embedding's cast was made in the first chunk and sent to the
    head's with every microbatch, whose partial gradient then named a parameter its stage did not
    hold (a KeyError at shard). Each reading chunk now casts the parameter itself; the pipeline trains
    as the same Config does on one device (SGD: the update is the gradient), to bf16's precision."""
    torch.manual_seed(0)
    model = TiedHead()

    def loss_fn(m, b):
        return torch.nn.functional.cross_entropy(m(b["idx"]).flatten(0, 1).float(), b["tgt"].flatten())
    optimizer = fxshard.optim.SGD(lr=0.5)
    config = fxshard.Config(schedule=kind, microbatches=4, param_dtype=torch.bfloat16)
    pieces = token_microbatches(40, 4)
    batch = concatenated(pieces)
    mesh = fxshard.Mesh(pp=2)  # traced with the casts to bf16, as shard() traces
    stages = [_compile(model, loss_fn, batch, optimizer, mesh, config, (stage,))[-1] for stage in range(2)]
    ranks = SimulatedRanks(stages, model, optimizer, mesh)
    one = fxshard.shard(model, loss_fn, batch, optimizer=optimizer,
                        config=fxshard.Config(microbatches=4, param_dtype=torch.bfloat16))
    for _ in range(2):
        expected = one(batch)["loss"].item()
        losses = [m["loss"].item() for m in ranks.step([batch] * 2)]
        assert all(abs(loss - expected) <= 1e-2 * abs(expected) for loss in losses), (losses, expected)
    # bf16 compute summed in another order: each parameter within 5% of its two steps' change (0.6-2.1% seen)
    params, trained, initial = ranks.parameters(rank=1), one.parameters(), model.state_dict()
    for name in trained:
        assert relative(params[name], trained[name]) <= 0.05 * relative(initial[name], trained[name]), name


class _RebindingEmbedding(torch.nn.Module):
    """Not a layer (it runs in `pre`): keeps a running mean of its output by rebinding."""

    def __init__(self, vocab, width):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, width)
        self.register_buffer("ema", torch.zeros(width))

    def forward(self, idx):
        y = self.emb(idx)
        self.ema = self.ema * 0.9 + 0.1 * y.detach().mean((0, 1))
        return y + self.ema


class _RebindingModel(torch.nn.Module):
    def __init__(self, vocab=20, width=8):
        super().__init__()
        self.embed = _RebindingEmbedding(vocab, width)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(4))
        self.blocks[0].register_buffer("last_loss", torch.zeros(()))
        self.head = torch.nn.Linear(width, vocab)

    def forward(self, idx):
        x = self.embed(idx)
        for block in self.blocks:
            x = x + torch.tanh(block(x))
        return self.head(x)


def test_a_rebound_buffers_write_back_belongs_to_where_it_was_rebound():
    """`self.ema = ...` in the embedding (before the first layer) is written back in `pre`, and a
    statistic of the loss kept in an early layer's buffer (`m.blocks[0].last_loss = loss.detach()`
    in loss_fn) in `post`, where its value is made: both train under Mesh(pp=2) as on one device.
    Tagging the write-back with the owner's layer made the first read as the head's and the second
    read a later chunk's value."""
    def loss_fn(m, b):
        loss = torch.nn.functional.cross_entropy(m(b["idx"]).flatten(0, 1), b["tgt"].flatten())
        m.blocks[0].last_loss = loss.detach()
        return loss
    torch.manual_seed(0)
    model = _RebindingModel()
    pieces = token_microbatches(20, 2, rows=2, seq=6)
    optimizer, mesh = fxshard.optim.SGD(lr=0.1), fxshard.Mesh(pp=2)
    config = fxshard.Config(microbatches=2)
    reference = copy.deepcopy(model)
    stages = [_compile(model, loss_fn, concatenated(pieces), optimizer, mesh, config, (s,))[-1] for s in range(2)]
    ranks = SimulatedRanks(stages, model, optimizer, mesh)
    ranks.step([concatenated(pieces)] * 2)
    with torch.no_grad():
        for piece in pieces:
            loss_fn(reference, piece)
    held = {o.name: state[InputKind.BUFFER, o.name] for p, state in zip(stages, ranks.states)
            for o in p.outputs_of(OutputKind.BUFFER)}
    assert held.keys() == {"embed.ema", "blocks.0.last_loss"}
    for name, value in reference.named_buffers():
        torch.testing.assert_close(held[name], value, rtol=1e-5, atol=1e-6)


class _SpectralModel(torch.nn.Module):
    """spectral_norm's power iteration writes its `_u` buffer (F.normalize(..., out=_u)) without reading it."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(11, 8)
        self.blocks = torch.nn.ModuleList(torch.nn.utils.parametrizations.spectral_norm(torch.nn.Linear(8, 8))
                                          for _ in range(2))
        self.head = torch.nn.Linear(8, 11)

    def forward(self, idx):
        x = self.embed(idx)
        for block in self.blocks:
            x = x + torch.tanh(block(x))
        return self.head(x)


def test_a_buffer_a_stage_writes_without_reading_is_its_input_too():
    """Each stage program takes every buffer it updates (a skipped step keeps the buffer as read:
    runtime/nonfinite.py, which failed with a KeyError on spectral_norm's `_u`), and the buffers
    after the step are eager's."""
    from fxshard.runtime.nonfinite import keep_buffers_when_skipped

    def loss_fn(m, b):
        return torch.nn.functional.cross_entropy(m(b["idx"]).flatten(0, 1), b["tgt"].flatten())
    torch.manual_seed(0)
    model = _SpectralModel()
    pieces = token_microbatches(11, 2, rows=2, seq=6)
    optimizer, mesh = fxshard.optim.SGD(lr=0.1), fxshard.Mesh(pp=2)
    reference = copy.deepcopy(model)
    stages = [_compile(model, loss_fn, concatenated(pieces), optimizer, mesh, fxshard.Config(microbatches=2), (s,))[-1]
              for s in range(2)]
    for stage in stages:
        updated = {o.name for o in stage.outputs_of(OutputKind.BUFFER)}
        assert updated and updated <= {i.name for i in stage.inputs if i.kind is InputKind.BUFFER}
        assert keep_buffers_when_skipped(stage.graph_module, stage)[1] == len(updated)
    ranks = SimulatedRanks(stages, model, optimizer, mesh)
    ranks.step([concatenated(pieces)] * 2)
    for piece in pieces:
        loss_fn(reference, piece)
    held = {o.name: state[InputKind.BUFFER, o.name] for p, state in zip(stages, ranks.states)
            for o in p.outputs_of(OutputKind.BUFFER)}
    assert held.keys() == {name for name, _ in reference.named_buffers()}
    for name, value in reference.named_buffers():
        torch.testing.assert_close(held[name], value, rtol=1e-5, atol=1e-6)
