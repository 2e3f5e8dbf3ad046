"""Codegen (fxshard/codegen.py): compiled regions compute what aten replay computes, and every node
whose order fxshard chose (communication, custom ops) keeps its place."""

import copy
import dataclasses
from collections import Counter

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

import fxshard
from fxshard import meta
from fxshard.api import _compile
from fxshard.codegen import _input_only_nodes, compile_regions, find_regions, is_communication, is_fixed
from fxshard.models import GPT, GPTConfig, MoEGPT, MoEGPTConfig
from fxshard.passes import run_pipeline
from fxshard.passes.fsdp import STRATEGIES, FSDPConfig, fsdp
from fxshard.share import CompileSplit, compile_owners
from fxshard.testing import assert_bit_identical, eager_parity
from strategies import MLPStack, mse, regression_batch, widths

ADAMW = fxshard.optim.AdamW(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def replay_compiler(graph_module, region):
    """Stands in for Inductor where a test is about partitioning, not kernels: the region's aten code."""
    return graph_module


def token_batches(vocab, batch, seq, count, seed=0):
    """Token batches whose leaves are non-contiguous views of one buffer, as a data loader's slices of
    a token buffer are (the compiled code expects contiguous leaves: the step makes them so)."""
    generator = torch.Generator().manual_seed(seed)
    pairs = [torch.stack([torch.randint(0, vocab, (batch, seq), generator=generator),
                          torch.randint(0, vocab, (batch, seq), generator=generator)], dim=-1) for _ in range(count)]
    return [{"idx": pair[..., 0], "tgt": pair[..., 1]} for pair in pairs]


def fixed_sequence(graph_module: fx.GraphModule) -> list[tuple]:
    """The fixed nodes in order, each as its target and its arguments (fixed inputs by position)."""
    names = {}
    sequence = []
    for node in graph_module.graph.nodes:
        if node.op == "call_module":
            continue
        if node.op == "get_attr" and node.target.startswith("folded_"):  # a constant codegen computed once
            names[node] = "computed"
            continue
        if node.op == "call_function" and node.target.__name__ == "getitem" and node.args[0].op == "call_module":
            names[node] = "computed"
            continue
        if is_fixed(node):
            names[node] = f"fixed {len(sequence)}"
            args = fx.node.map_arg((node.args, node.kwargs), lambda a: names.get(a, "computed"))
            sequence.append((node.op, str(node.target), repr(args)))
    return sequence


def test_codegen_is_off_on_cpu_by_default_and_validated():
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny"))
    batch = token_batches(64, 2, 8, 1)[0]
    step = fxshard.shard(model, lambda m, b: m.loss(b), batch, optimizer=ADAMW)
    assert step.codegen is None and "codegen: off" in step.lowerings()
    with pytest.raises(fxshard.FxShardError, match="codegen='triton'; choose one of"):
        fxshard.Config(codegen="triton")
    with pytest.raises(fxshard.FxShardError, match="codegen_regions='block'; choose one of"):
        fxshard.Config(codegen_regions="block")


@settings(deadline=None)
@given(layer_widths=widths, world=st.integers(1, 4), strategy=st.sampled_from(STRATEGIES),
       prefetch=st.integers(0, 2), clip=st.sampled_from([None, 0.5]))
def test_regions_keep_every_fixed_node_in_place_and_compute_the_same(layer_widths, world, strategy, prefetch, clip):
    torch.manual_seed(0)
    model = MLPStack(layer_widths)
    generator = torch.Generator().manual_seed(1)
    local = [regression_batch(generator, 2) for _ in range(world)]
    traced = fxshard.trace(model, mse, local[0], optimizer=ADAMW, config=fxshard.Config(clip_grad_norm=clip))
    program = fsdp(traced, FSDPConfig(world, strategy, prefetch))
    compiled, report = compile_regions(program.graph_module, compiler=replay_compiler)
    assert fixed_sequence(compiled) == fixed_sequence(program.graph_module)
    assert world == 1 or any(is_communication(n) for n in compiled.graph.nodes)
    for region in report.regions:  # no region holds a node whose place was decided
        assert not any(is_fixed(n) for n in region.nodes)
    assert_bit_identical([program, program.replace(graph_module=compiled)], model, ADAMW,
                         fxshard.Mesh(dp=world), local)


def test_expert_parallel_windows_survive_codegen():
    """EP with overlap: each all-to-all's wait stays after the GEMMs the overlap pass put in its window."""
    torch.manual_seed(0)
    model = MoEGPT(MoEGPTConfig.preset("tiny", n_expert=4))
    batch = {"idx": torch.randint(0, 64, (2, 8)), "tgt": torch.randint(0, 64, (2, 8))}
    config = fxshard.Config(ep_overlap=True, ep_chunks=2)
    program = fxshard.trace(model, lambda m, b: m.loss_and_metrics(b), batch, optimizer=ADAMW, config=config)
    per_rank = run_pipeline(program, fxshard.Mesh(dp=2, ep=2), config)[-1]
    compiled, report = compile_regions(per_rank.graph_module, compiler=replay_compiler)
    assert fixed_sequence(compiled) == fixed_sequence(per_rank.graph_module)
    # between an all-to-all and its wait, the original program computes; so does the compiled one
    nodes = list(compiled.graph.nodes)
    windows = [(nodes.index(n), nodes.index(next(iter(n.users)))) for n in nodes
               if n.op == "call_function" and "all_to_all_single" in str(n.target)]
    assert windows and any(any(m.op == "call_module" for m in nodes[i:j]) for i, j in windows)
    generator = torch.Generator().manual_seed(2)
    local = [{"idx": torch.randint(0, 64, (2, 8), generator=generator),
              "tgt": torch.randint(0, 64, (2, 8), generator=generator)} for _ in range(2)]
    assert_bit_identical([per_rank, per_rank.replace(graph_module=compiled)], model, ADAMW,
                         fxshard.Mesh(dp=2, ep=2), local)


def test_a_region_inductor_cannot_compile_runs_as_aten_replay_with_a_warning():
    torch.manual_seed(0)
    model = MLPStack([4, 4])
    generator = torch.Generator().manual_seed(1)
    batch = regression_batch(generator, 2)
    program = fxshard.trace(model, mse, batch, optimizer=ADAMW)

    def failing(graph_module, region):
        raise RuntimeError("no kernel for this op")

    with pytest.warns(UserWarning, match=r"region_0 \(\d+ nodes, .*\) runs as aten replay: Inductor could not "
                                         r"compile it \(RuntimeError: no kernel for this op\)"):
        compiled, report = compile_regions(program.graph_module, compiler=failing)
    assert report.count("fallback") == len(find_regions(program.graph)) > 0
    assert_bit_identical([program, program.replace(graph_module=compiled)], model, ADAMW, fxshard.Mesh(dp=1), [batch])


def test_input_free_compute_is_folded_into_constants_once():
    """GPT's RoPE tables read no input of the step: codegen computes them once, the rest is unchanged."""
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny"))
    batches = token_batches(64, 2, 8, 2)
    program = fxshard.trace(model, lambda m, b: m.loss(b), batches[0], optimizer=ADAMW)
    compiled, report = compile_regions(program.graph_module, compiler=replay_compiler)
    assert [value.shape[0] for value in report.folded.values()] == [8, 8], report.folded  # cos, sin: [seq, .]
    assert not any("cos" in str(n.target) for region in report.regions for n in region.nodes)
    assert fixed_sequence(compiled) == fixed_sequence(program.graph_module)
    assert "constants folded" in report.line() and "folded_0: constant" in report.table()
    assert_bit_identical([program, program.replace(graph_module=compiled)], model, ADAMW, fxshard.Mesh(dp=1), batches[:1])


@pytest.mark.parametrize("world, param_dtype", [(1, None), (2, None), (1, torch.bfloat16)])
def test_identical_layers_compile_once(world, param_dtype):
    """Every layer's forward and backward is a region, with or without communication to cut at:
    the number of regions compiled does not grow with the depth. With bf16 compute the parameters'
    casts run first, once per step: they do not make the whole forward one region."""
    compiled = {}
    for n_layer in (4, 6):
        torch.manual_seed(0)
        model = GPT(GPTConfig.preset("tiny", n_layer=n_layer))
        batch = token_batches(64, 2, 8, 1)[0]
        program = fxshard.trace(model, lambda m, b: m.loss(b), batch, optimizer=ADAMW,
                                config=fxshard.Config(param_dtype=param_dtype))
        if world > 1:
            program = fsdp(program, FSDPConfig(world, "optim_grads_params", 1))
        calls = []
        _, report = compile_regions(program.graph_module, compiler=lambda gm, region: calls.append(region) or gm)
        assert report.count("cache hit") >= 2 * (n_layer - 2)  # the middle layers' forward and backward repeat
        assert len(calls) == report.count("compiled") == len({r.key for r in calls})
        assert {f"fwd layers.{i}" for i in range(n_layer)} <= {r.where for r in report.regions}
        for i in range(2, n_layer):  # the same code as layers.1's, matmuls included
            forward = [r for r in report.regions if r.where == f"fwd layers.{i}"]
            assert all(r.status == "cache hit" for r in forward)
            assert any(n.target is torch.ops.aten.mm.default for r in forward for n in r.nodes)
        compiled[n_layer] = len(calls)
        if world == 1:  # Config(codegen_regions="communication"): nothing to cut at on one device
            _, whole = compile_regions(program.graph_module, compiler=lambda gm, region: gm, by_layer=False)
            assert whole.count("compiled") == 1 and whole.regions[0].where != "fwd layers.0"
    assert compiled[4] == compiled[6]


def test_ranks_of_one_host_and_cache_split_the_regions_they_share():
    """share_compile's assignment: each key to one rank of the ranks that share a host and an Inductor
    cache directory and need it, the fewest keys each; ranks elsewhere compile what they need."""
    here, other_dir, other_host = ("a", "/c"), ("a", "/d"), ("b", "/c")
    everyone = [(here, ["k0", "k1", "k2", "k3", "k4"]), (here, ["k0", "k1", "k2", "k3", "k4"]),
                (here, ["k0", "k5"]), (other_dir, ["k0", "k1"]), (other_host, ["k0"])]
    owners = [compile_owners(everyone, rank) for rank in range(len(everyone))]
    # k5 only rank 2 needs: it goes first; k0, which three ranks need, last, to the one with the fewest
    assert owners[0] == {"k0": 2, "k1": 0, "k2": 1, "k3": 0, "k4": 1}
    assert owners[1] == owners[0] and owners[2] == {"k0": 2, "k5": 2}
    assert owners[3] == {"k0": 3, "k1": 3} and owners[4] == {"k0": 4}


def test_a_split_compile_compiles_this_ranks_share_first_then_the_rest():
    """compile_regions with a split: this rank's keys first, one wait, then the others' keys (from the
    cache, in a real job), each key compiled once; the program computes the same bits."""
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny", n_layer=3))
    batches = token_batches(64, 2, 8, 1)
    program = fxshard.trace(model, lambda m, b: m.loss(b), batches[0], optimizer=ADAMW)
    events = []

    def split(keys):
        events.append(("keys", list(keys)))
        owner = {k: i % 2 for i, k in enumerate(keys)}  # this is rank 0 of two
        return CompileSplit({k for k in keys if owner[k] == 0}, owner, lambda: events.append(("wait",)), 0)

    def compiler(graph_module, region):
        events.append(("compile", region.key))
        return graph_module
    compiled, report = compile_regions(program.graph_module, compiler=compiler, split=split)
    (_, keys), *rest = events
    wait = rest.index(("wait",))
    assert [key for _, key in rest[:wait]] == keys[::2] and [key for _, key in rest[wait + 1:]] == keys[1::2]
    assert len(keys) == len(set(keys)) == report.count("compiled") and ("wait",) not in rest[wait + 1:]
    assert {r.key for r in report.regions if r.compiled_first_by == 1} == set(keys[1::2])
    assert f"({len(keys[1::2])} first compiled by another rank of this host)" in report.line()
    assert "(rank 1 compiled it first)" in report.table()
    assert_bit_identical([program, program.replace(graph_module=compiled)], model, ADAMW, fxshard.Mesh(dp=1), batches)
    for share in (set(keys), set()):  # all or nothing of its own: it still waits, once
        events.clear()
        compile_regions(program.graph_module, compiler=compiler,
                        split=lambda keys: CompileSplit(share, dict.fromkeys(keys, 0 if share else 1),
                                                        lambda: events.append(("wait",)), 0))
        assert events.count(("wait",)) == 1 and len(events) == len(keys) + 1


def pipeline_stages(mesh, config, model, batch):
    program = fxshard.trace(model, lambda m, b: m.loss(b), batch, optimizer=ADAMW)
    return [run_pipeline(program, mesh, config, stage=stage)[-1] for stage in range(mesh.pp)]


def test_pipeline_stages_keep_their_transfers_in_place_under_codegen():
    """Each stage's program (sends, receives, waits, FSDP's collectives) compiled region by region:
    the fixed sequence, point-to-point included, is unchanged and the step computes the same bits.
    A region never holds two pipeline actions' nodes, and under torch.profiler each region's call is a
    range naming its action (what bench/pipeline.py attributes kernels to actions by)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=24, d_model=16, n_layer=2, n_head=2, d_ff=24))
    mesh, config = fxshard.Mesh(pp=2, dp=2), fxshard.Config(microbatches=2, schedule="zb-h1", sharding="optim")
    batches = token_batches(24, 2, 8, 4, seed=3)
    stages = pipeline_stages(mesh, config, model, batches[0])
    compiled = []
    for program in stages:
        graph_module, report = compile_regions(program.graph_module, compiler=replay_compiler)
        assert fixed_sequence(graph_module) == fixed_sequence(program.graph_module)
        assert any(n.target is torch.ops.fxshard.recv.default for n in graph_module.graph.nodes)
        assert report.regions and not any(is_fixed(n) for r in report.regions for n in r.nodes)
        assert all(len({meta.action_index(n) for n in r.nodes} - {None}) <= 1 for r in report.regions)
        compiled.append(program.replace(graph_module=graph_module))
    local = [{k: torch.cat([b[k] for b in batches[d * 2:(d + 1) * 2]]) for k in batches[0]} for d in range(2)]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
        assert_bit_identical([stages, compiled], model, ADAMW, mesh, [local[mesh.coords(r)["dp"]] for r in range(4)])
    ranges = {event.name for event in profiler.events() if event.name.startswith("fxshard region_")}
    backward = next(r for r in report.regions if r.where.startswith("bwd layers.1"))
    assert f"fxshard {backward.name} [{backward.where}]" in ranges and " mb " in backward.where
    assert stages[-1].stage.actions[int(backward.where.split("action ")[1])].kind == "B"


def test_a_pipeline_actions_layer_is_one_region_even_where_a_pass_copied_views_into_it():
    """Mesh(pp=2) with bf16 compute: the fsdp pass copies parameters' views next to their readers
    without an action of their own; they join the region they sit in instead of cutting it. And the
    views and casts of the flat units at the top of a stage's program do not claim the layers: the
    first microbatch's forward is a region per layer too, the same code as the next microbatch's
    after the stage's first layer (which also holds the step's casts). It was one region, which
    profiles showed as one layer 5 ms a step slower than the others."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=24, d_model=16, n_layer=4, n_head=2, d_ff=24))
    config = fxshard.Config(microbatches=2, schedule="1f1b", param_dtype=torch.bfloat16)
    mesh, batch = fxshard.Mesh(pp=2), token_batches(24, 2, 8, 1)[0]
    stages = pipeline_stages(mesh, config, model, batch)
    stages += [_compile(model, lambda m, b: m.loss(b), batch, ADAMW, mesh, dataclasses.replace(config, sharding="no_shard"),
                        (stage,))[-1] for stage in range(mesh.pp)]  # as shard() makes them: flat units' views first
    for program in stages:
        _, report = compile_regions(program.graph_module, compiler=replay_compiler)
        with_matmuls = [r for r in report.regions if any(n.target is torch.ops.aten.mm.default for n in r.nodes)]
        pieces = Counter((meta.action_index(r.nodes[-1]), r.where.split(" mb")[0]) for r in with_matmuls)
        assert pieces and max(pieces.values()) == 1, pieces
        for region in with_matmuls:
            layers = {meta.layer(n) for n in region.nodes if n.target is torch.ops.aten.mm.default}
            assert len(layers) == 1, (region.where, layers)
        forward = {(meta.microbatch(r.nodes[-1]), meta.layer(r.nodes[-1])): r.key for r in with_matmuls
                   if r.where.startswith("fwd layers.")}
        later = sorted({layer for _, layer in forward})[1:]
        assert later and all(forward[0, layer] == forward[1, layer] for layer in later), forward


def test_views_and_casts_of_inputs_are_input_only_and_nothing_past_a_fixed_node_is():
    """What joins the next layer's region instead of claiming its own: a flat unit's slice, its view,
    the view's cast and the cast's transpose; not a matmul on them, not a view of a collective's result."""
    graph = fx.Graph()
    unit, x = graph.placeholder("unit"), graph.placeholder("x")
    weight = graph.call_function(torch.ops.aten.reshape.default, (graph.call_function(
        torch.ops.aten.slice.Tensor, (unit, 0, 0, 16)), [4, 4]))
    transposed = graph.call_function(torch.ops.aten.t.default, (graph.call_function(
        torch.ops.aten._to_copy.default, (weight,), {"dtype": torch.bfloat16}),))
    product = graph.call_function(torch.ops.aten.mm.default, (x, transposed))
    waited = graph.call_function(torch.ops._c10d_functional.wait_tensor.default, (x,))
    view_of_waited = graph.call_function(torch.ops.aten.reshape.default, (waited, [-1]))
    graph.output((product, view_of_waited))
    input_only = _input_only_nodes(graph)
    assert {weight, transposed, weight.args[0], transposed.args[0]} <= input_only
    assert not {product, waited, view_of_waited} & input_only


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_a_pipeline_gradient_is_accumulated_in_the_region_that_made_it(schedule):
    """Mesh(pp=2), 3 microbatches, bf16 compute with fp32 gradients: each microbatch's gradient is
    cast to fp32 and added to the accumulator in the same region, so Inductor fuses cast and add and
    the fp32 cast is never written out (GPT 1b, 2x H100: 4.6 ms of such casts a step on a stage).
    Weight matrices' accumulations unfused (Config(fuse_grad_accumulation=False)), to have many."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=24, d_model=16, n_layer=4, n_head=2, d_ff=24))
    config = fxshard.Config(microbatches=3, schedule=schedule, param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                            fuse_grad_accumulation=False)
    mesh, batch = fxshard.Mesh(pp=2), token_batches(24, 3, 8, 1)[0]
    for stage in range(mesh.pp):  # traced as shard() does: one microbatch, in the compute dtype
        program = _compile(model, lambda m, b: m.loss(b), batch, ADAMW, mesh, config, (stage,))[-1]
        region_of = {n: r.index for r in find_regions(program.graph) for n in r.nodes}
        accumulations = [n for n in program.graph.nodes if n.target is torch.ops.aten.add.Tensor
                         and meta.phase(n) == meta.BWD and meta.microbatch(n) in (1, 2)
                         and all(getattr(a, "target", None) is torch.ops.aten._to_copy.default or
                                 getattr(a, "target", None) is torch.ops.aten.add.Tensor for a in n.args)
                         and any(meta.microbatch(a) == meta.microbatch(n) and a.meta["val"].dtype == torch.float32
                                 and a.target is torch.ops.aten._to_copy.default for a in n.args)]
        assert len(accumulations) >= 2 * 2 * 4, len(accumulations)  # 2 later microbatches, >= 4 weights a layer
        for add in accumulations:
            (cast,) = [a for a in add.args if meta.microbatch(a) == meta.microbatch(add)]
            assert region_of[add] == region_of[cast], (add.name, cast.name)


def test_a_moe_model_as_pipeline_stages_compiled_by_inductor_trains_like_eager():
    """MoEGPT tiny cut into two pipeline stages, each stage's program compiled by Inductor region by
    region (attention, the router and the grouped expert ops between regions, sends and receives
    between them), trained on two simulated ranks: the losses and parameters of eager PyTorch. The
    one Inductor test in this process: GPT tiny's dense blocks under Inductor are checked on two gloo
    ranks under ZeRO-3, through `shard` and its codegen dump (tests/test_parity_fsdp_gloo.py); each
    Inductor test costs the 2-core CI machine 50-80 s of compiling."""
    from fxshard.testing import SimulatedRanks, relative, torch_optimizer

    torch.manual_seed(0)
    model = MoEGPT(MoEGPTConfig.preset("tiny"))
    mesh, config = fxshard.Mesh(pp=2), fxshard.Config(microbatches=2)
    batches = token_batches(64, 4, 32, 3, seed=4)
    stages, tables = [], []
    for program in pipeline_stages(mesh, config, model, {k: v[:2] for k, v in batches[0].items()}):
        graph_module, report = compile_regions(program.graph_module)
        stages.append(program.replace(graph_module=graph_module))
        tables.append(report.table())
    for table in tables:  # Inductor compiled every region, and its code is named
        assert " 0 fell back to aten" in table and "compiled in" in table and "generated code: " in table, table
    ranks = SimulatedRanks(stages, model, ADAMW, mesh)
    reference = copy.deepcopy(model)
    optimizer = torch_optimizer(ADAMW, reference.parameters())
    for batch in batches:
        metrics = ranks.step([batch, batch])
        optimizer.zero_grad()
        loss = sum(reference.loss({k: v[i * 2:(i + 1) * 2] for k, v in batch.items()}) for i in range(2)) / 2
        loss.backward()
        optimizer.step()
        assert abs(metrics[1]["loss"].item() - loss.item()) <= 1e-5 * abs(loss.item())
    params = ranks.parameters()
    # AdamW divides by sqrt(v): a weight whose gradient is near eps (an expert that sees few tokens)
    # moves by the last bits of its gradient, which fused kernels round differently
    assert max(relative(params[n], p) for n, p in reference.named_parameters()) < 3e-4


class CachedAttention(nn.Module):
    """Attention whose keys and values are appended to an empty cache tensor, as transformers'
    DynamicCache does on a model's first forward (`torch.cat([tensor([]), keys], -2)`): Inductor lays
    that cat out in the keys' transposed strides, where eager and the trace make it contiguous."""

    def __init__(self, dim=16, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        batch, seq, dim = x.shape
        q, k, v = self.qkv(x).view(batch, seq, 3, self.heads, dim // self.heads).unbind(2)
        k, v = (torch.cat([x.new_empty(0), t.transpose(1, 2)], -2) for t in (k, v))
        attended = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, is_causal=True)
        return x + self.out(attended.transpose(1, 2).reshape(batch, seq, dim))


def test_outputs_inductor_lays_out_otherwise_than_traced_are_copied_into_the_traced_layout(monkeypatch):
    """Without the copy (codegen.CompiledRegion.conformed) the backward's compiled region failed its
    input check on the saved keys (every transformers decoder called with its default cache, on CPU),
    and the error blamed the batch: it now names the layout check as codegen's defect."""
    from fxshard.codegen import CompiledRegion

    torch.manual_seed(0)
    model = nn.Sequential(CachedAttention(), CachedAttention())
    generator = torch.Generator().manual_seed(1)
    batches = [{"x": torch.randn(2, 8, 16, generator=generator), "y": torch.randn(2, 8, 16, generator=generator)}
               for _ in range(2)]

    def loss_fn(m, b):
        return F.mse_loss(m(b["x"]), b["y"])
    config = fxshard.Config(codegen="inductor")
    parity = eager_parity(model, loss_fn, batches, ADAMW, config=config)
    assert parity.max_loss_rel < 1e-5 and parity.max_param_rel < 1e-5, parity
    monkeypatch.setattr(CompiledRegion, "conformed", lambda self, outputs: outputs)  # the regions as before
    step = fxshard.shard(model, loss_fn, batches[0], optimizer=ADAMW, config=config)
    with pytest.raises(fxshard.FxShardError, match="a compiled region's check of its inputs' layouts, not the batch"):
        step(batches[0])
