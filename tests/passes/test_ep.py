"""The expert-parallel pass: per-rank programs (SPMD simulator) train like the single-device program."""

import copy

import pytest
import torch
from hypothesis import given, settings, strategies as st

import fxshard
from fxshard import meta, moe
from fxshard.models import MoEGPT, MoEGPTConfig
from fxshard.passes import run_pipeline
from fxshard.passes.ep import EPConfig, expert_parallel, receive_order
from fxshard.passes.fsdp import STRATEGIES
from fxshard.program import InputKind, Output, OutputKind, Routing
from fxshard.testing import SimulatedRanks, torch_optimizer

ADAMW = fxshard.optim.AdamW(lr=1e-2, weight_decay=0.1)
c10d = torch.ops._c10d_functional


def loss_and_metrics(model, batch):
    return model.loss_and_metrics(batch)


def batches_for(world, steps, rows, seq, vocab, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [[{"idx": torch.randint(0, vocab, (rows, seq), generator=generator),
              "tgt": torch.randint(0, vocab, (rows, seq), generator=generator)} for _ in range(world)]
            for _ in range(steps)]


def compile_ep(model, local_batch, optimizer, mesh, config):
    program = fxshard.trace(model, loss_and_metrics, local_batch, optimizer=optimizer, config=config)
    return program, run_pipeline(program, mesh, config)


meshes = st.sampled_from([(2, 2), (4, 2), (4, 4), (8, 4), (6, 3), (2, 1)])


@given(mesh=meshes, experts_per_rank=st.integers(1, 3), top_k=st.integers(1, 3), d_model=st.sampled_from([8, 12]),
       d_ff=st.sampled_from([4, 8]), capacity=st.sampled_from([None, 0.5, 1.0, 1.5]), overlap=st.booleans(),
       chunks=st.integers(2, 3), sharding=st.sampled_from(STRATEGIES), shared=st.booleans())
def test_ep_programs_match_the_single_device_program(mesh, experts_per_rank, top_k, d_model, d_ff, capacity,
                                                     overlap, chunks, sharding, shared):
    """One SGD step: the ranks' loss is the mean, and their parameters the mean, of the un-rewritten
    program run on each rank's batch (for plain SGD, that is one device on the concatenated batch)."""
    world, ep = mesh
    experts = ep * experts_per_rank
    cfg = MoEGPTConfig(vocab_size=16, d_model=d_model, n_layer=2, n_head=2, n_expert=experts,
                       top_k=min(top_k, experts), d_ff_expert=d_ff, d_ff_shared=d_ff if shared else None,
                       capacity_factor=capacity)
    torch.manual_seed(0)
    model = MoEGPT(cfg)
    sgd = fxshard.optim.SGD(lr=0.5)
    (local,) = batches_for(world, 1, rows=2, seq=4, vocab=16)
    config = fxshard.Config(sharding=sharding, ep_overlap=overlap, ep_chunks=chunks)
    traced, programs = compile_ep(model, local[0], sgd, fxshard.Mesh(dp=world, ep=ep), config)
    ranks = SimulatedRanks(programs[-1], model, sgd, fxshard.Mesh(dp=world, ep=ep))
    metrics = ranks.step(local)
    singles = [SimulatedRanks(traced, model, sgd, fxshard.Mesh()) for _ in range(world)]
    expected = [s.step([batch])[0] for s, batch in zip(singles, local)]
    mean_loss = sum(e["loss"] for e in expected) / world
    dropped = sum(e["moe_dropped_tokens"] for e in expected)
    for rank_metrics in metrics:
        assert torch.allclose(rank_metrics["loss"], mean_loss, rtol=1e-5, atol=1e-7)
        assert rank_metrics["moe_dropped_tokens"] == dropped
        if ep > 1:  # the pass reports each layer's drops too
            layer_drops = sum(values["dropped"] for values in programs[-1].routing(rank_metrics).values())
            assert layer_drops == dropped
    reference = [s.parameters() for s in singles]
    for rank in range(world):
        params = ranks.parameters(rank)
        for name in reference[0]:
            mean = sum(r[name] for r in reference) / world
            assert torch.allclose(params[name], mean, rtol=1e-5, atol=1e-6), (name, rank)


@settings(max_examples=4)
@given(mesh=st.sampled_from([(2, 2), (4, 2), (4, 4)]), capacity=st.sampled_from([None, 1.0]), overlap=st.booleans(),
       sharding=st.sampled_from(STRATEGIES), clip=st.sampled_from([None, 0.05]))
def test_ep_trains_like_eager_pytorch_with_adamw(mesh, capacity, overlap, sharding, clip):
    """Three AdamW steps (optionally clipped) against eager PyTorch on the concatenated batch: the loss
    is the mean of the ranks' local losses, as data parallelism defines it (routing per rank)."""
    world, ep = mesh
    cfg = MoEGPTConfig(vocab_size=16, d_model=8, n_layer=2, n_head=2, n_expert=2 * ep, top_k=2, d_ff_expert=8,
                       d_ff_shared=None, capacity_factor=capacity)
    torch.manual_seed(1)
    model = MoEGPT(cfg)
    reference = copy.deepcopy(model)
    steps = batches_for(world, 3, rows=2, seq=4, vocab=16, seed=1)
    config = fxshard.Config(sharding=sharding, ep_overlap=overlap, ep_chunks=2, clip_grad_norm=clip)
    _, programs = compile_ep(model, steps[0][0], ADAMW, fxshard.Mesh(dp=world, ep=ep), config)
    ranks = SimulatedRanks(programs[-1], model, ADAMW, fxshard.Mesh(dp=world, ep=ep))
    optimizer = torch_optimizer(ADAMW, reference.parameters())
    for local in steps:
        metrics = ranks.step(local)
        optimizer.zero_grad()
        loss = sum(reference.loss(batch) for batch in local) / world
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), clip if clip else float("inf"))
        optimizer.step()
        assert torch.allclose(metrics[0]["loss"], loss.detach(), rtol=1e-5), (metrics[0]["loss"], loss)
        assert torch.allclose(metrics[0]["grad_norm"], norm, rtol=1e-4), (metrics[0]["grad_norm"], norm)
    params = ranks.parameters(world - 1)
    for name, value in reference.named_parameters():
        # AdamW divides each gradient by its running RMS, so summation-order noise in near-zero gradients
        # shows at up to ~1e-5 absolute (0.1% of lr) after three steps; plain data parallelism (ep=1)
        # deviates from eager just as much, at the same elements
        assert torch.allclose(params[name], value.detach(), rtol=1e-4, atol=5e-5), name


def tiny_moe_program(ep=2, overlap=False, experts=4, capacity=None, fused=False, optimizer=ADAMW):
    torch.manual_seed(0)
    model = MoEGPT(MoEGPTConfig.preset("tiny", n_expert=experts, capacity_factor=capacity))
    batch = {"idx": torch.randint(0, 64, (2, 8)), "tgt": torch.randint(0, 64, (2, 8))}
    program = fxshard.trace(model, loss_and_metrics, batch, optimizer=optimizer,
                            config=fxshard.Config(fuse_grouped_mlp=fused))
    if fused:
        program = fxshard.passes.fuse_grouped_mlp(program)
    return model, program, expert_parallel(program, EPConfig(ep, 2 if overlap else 1))


def test_expert_parameters_are_split_and_each_layer_gets_its_all_to_alls():
    _, traced, program = tiny_moe_program(ep=2)
    experts = {s.name: s for s in program.inputs if s.kind is InputKind.PARAM and s.placement.axis == "ep"}
    assert set(experts) == {f"layers.{i}.moe.experts.fc{j}.weight" for i in range(2) for j in (1, 2)}
    for spec in experts.values():
        assert spec.shape[0] == 2  # 4 experts over 2 ranks
    pieces = [(meta.layer(n), meta.phase(n), n.meta[meta.MOE_PIECE]) for n in program.graph.nodes
              if n.target is c10d.all_to_all_single.default]
    for layer in ("layers.0", "layers.1"):
        # counts (route), then tokens there and back in the forward, gradients there and back in the backward
        assert [(p, piece) for l, p, piece in pieces if l == layer] == [
            ("fwd", "route"), ("fwd", "dispatch"), ("fwd", "combine"), ("bwd", "dispatch"), ("bwd", "combine")]
    assert "buffer 32 rows x 2 ranks" in program.notes["ep"]


def test_overlap_interleaves_chunks_issue_early_wait_late():
    """With ep_overlap the forward issues every chunk's dispatch before the first chunk's experts run,
    and chunk 0's combine is issued before chunk 1's experts: communication and compute interleave."""
    _, _, program = tiny_moe_program(ep=2, overlap=True)
    events = []
    for node in program.graph.nodes:
        if meta.layer(node) != "layers.0" or meta.phase(node) != meta.FWD or meta.MOE_PIECE not in node.meta:
            continue
        if node.target is c10d.all_to_all_single.default:
            events.append((node.meta[meta.MOE_PIECE], node.meta.get(meta.MOE_CHUNK)))
        elif node.target is torch.ops.fxshard.grouped_mm.default:
            events.append(("gemm", node.meta[meta.MOE_CHUNK]))
    assert events == [("route", None), ("dispatch", 0), ("dispatch", 1), ("gemm", 0), ("gemm", 0), ("combine", 0),
                      ("gemm", 1), ("gemm", 1), ("combine", 1)]


def test_ep_composes_with_the_fused_grouped_mlp():
    sgd = fxshard.optim.SGD(lr=0.5)  # AdamW's first step is lr * sign(g): it would magnify rounding noise
    model, traced, program = tiny_moe_program(ep=2, fused=True, capacity=1.0, optimizer=sgd)
    assert any(n.target is torch.ops.fxshard.grouped_mlp_fwd.default for n in program.graph.nodes)
    from fxshard.passes.fsdp import FSDPConfig, fsdp

    per_rank = fsdp(program, FSDPConfig(2, "optim_grads_params", ep=2))
    ranks = SimulatedRanks(per_rank, model, sgd, fxshard.Mesh(dp=2, ep=2))
    fsdp_only = SimulatedRanks(fsdp(traced, FSDPConfig(2)), model, sgd, fxshard.Mesh(dp=2))
    local = batches_for(2, 1, rows=2, seq=8, vocab=64)[0]
    ours, theirs = ranks.step(local)[0], fsdp_only.step(local)[0]
    assert torch.allclose(ours["loss"], theirs["loss"], rtol=1e-5)
    for name, value in fsdp_only.parameters().items():
        assert torch.allclose(ranks.parameters()[name], value, rtol=1e-5, atol=1e-6), name


def test_bad_meshes_and_models_are_refused():
    with pytest.raises(fxshard.FxShardError, match="ep must divide dp"):
        fxshard.Mesh(dp=4, ep=3)
    with pytest.raises(fxshard.FxShardError, match="must divide the number of experts"):
        tiny_moe_program(ep=3, experts=4)
    from fxshard.models import GPT, GPTConfig

    gpt = fxshard.trace(GPT(GPTConfig.preset("tiny")), lambda m, b: m.loss(b),
                        {"idx": torch.zeros(1, 8, dtype=torch.long), "tgt": torch.zeros(1, 8, dtype=torch.long)})
    with pytest.raises(fxshard.FxShardError, match="the model has no MoE layer: its traced forward routes no token"):
        expert_parallel(gpt, EPConfig(2))

    class EveryExpertOverEveryToken(torch.nn.Module):  # a top-k router, then one batched matmul of all experts
        def __init__(self):
            super().__init__()
            self.router, self.experts = torch.nn.Linear(8, 4), torch.nn.Parameter(torch.randn(4, 8, 8))

        def forward(self, x):
            scores, chosen = self.router(x).topk(2)
            gates = torch.zeros(x.shape[0], 4).scatter(1, chosen, scores.softmax(-1))
            return torch.einsum("te,eio,ti->to", gates, self.experts, x)

    dense_experts = fxshard.trace(EveryExpertOverEveryToken(), lambda m, b: m(b).square().mean(), torch.randn(6, 8))
    with pytest.raises(fxshard.FxShardError, match="no MoE layer fxshard can split .* experts compute otherwise"):
        expert_parallel(dense_experts, EPConfig(2))
    indexed = MoEGPT(MoEGPTConfig.preset("tiny", expert_weights="indexed"))
    program = fxshard.trace(indexed, loss_and_metrics, {"idx": torch.zeros(1, 8, dtype=torch.long),
                                                        "tgt": torch.zeros(1, 8, dtype=torch.long)})
    with pytest.raises(fxshard.FxShardError, match=r"cannot split these expert weights: .*joins parameters along dim 0 .*"
                                                   r"expert_weights='grouped'"):
        expert_parallel(program, EPConfig(2))


def test_dumps_show_each_layers_all_to_alls_and_the_routing(tmp_path):
    from fxshard.dump import dump_program, dump_routing

    model, _, program = tiny_moe_program(ep=2, overlap=True, capacity=1.0)
    dump_program(program.replace(name="ep"), tmp_path, 1)
    summary = (tmp_path / "01_ep.summary.txt").read_text()
    assert "layers.0: 4 experts (2/rank), top-2, 16 tokens -> 32 rows, capacity 8/expert" in summary
    for piece in ("route", "dispatch[0]", "dispatch[1]", "combine[0]", "combine[1]"):
        assert f"layers.1:{piece}" in summary, piece
    ranks = SimulatedRanks(program, model, ADAMW, fxshard.Mesh(dp=2, ep=2))
    metrics = ranks.step(batches_for(2, 1, rows=2, seq=8, vocab=64)[0])[0]
    routing = program.routing(metrics)
    assert set(routing) == {"layers.0", "layers.1"}  # from the outputs' typed records, not their names
    assert all(spec.routing.name == spec.name for spec in program.outputs if spec.routing is not None)
    with pytest.raises(ValueError, match="does not match its fields"):  # a name that disagrees with its record
        Output(OutputKind.METRIC, "moe/layers.0/dropped", routing=Routing("layers.1", "dropped"))
    table = (tmp_path / "routing.txt")
    assert dump_routing(routing, tmp_path) == str(table)
    rows = {line.split()[0]: line.split() for line in table.read_text().splitlines()[1:]}
    assert set(rows) == {"layers.0", "layers.1"}
    for layer, fields in rows.items():  # per rank: 32 rows routed, some dropped at capacity 8 per expert
        kept = sum(metrics[f"moe/{layer}/tokens_per_expert"]).item()
        assert int(fields[1]) == kept and int(fields[2]) == metrics[f"moe/{layer}/dropped"].item()
        assert kept + int(fields[2]) == 32


@pytest.mark.parametrize("variant", ["microbatches", "glu_interleaved", "meta_device", "frozen_experts_zero3",
                                     "frozen_experts_no_shard", "bf16"])
def test_ep_matches_plain_data_parallelism_across_features(variant):
    """Mesh(dp=4, ep=2) against Mesh(dp=4) (already checked against one device) on one SGD step, with
    gradient accumulation, GLU-interleaved fc1 rows, a meta-device model, a frozen expert weight, bf16."""
    from fxshard.init import MetaInit

    sgd = fxshard.optim.SGD(lr=0.5)
    cfg = MoEGPTConfig.preset("tiny", glu_interleave_size=16 if variant == "glu_interleaved" else None)
    torch.manual_seed(0)
    if variant == "meta_device":
        with torch.device("meta"):
            model = MoEGPT(cfg)
    else:
        model = MoEGPT(cfg)
    if variant.startswith("frozen"):
        model.layers[0].moe.experts.fc1.weight.requires_grad_(False)
    config = fxshard.Config(microbatches=2 if variant == "microbatches" else 1,
                            sharding="no_shard" if variant.endswith("no_shard") else "optim_grads_params",
                            param_dtype=torch.bfloat16 if variant == "bf16" else None)
    local = batches_for(4, 1, rows=2, seq=8, vocab=64)[0]
    results = []
    for ep in (1, 2):
        mesh = fxshard.Mesh(dp=4, ep=ep)
        program = run_pipeline(fxshard.trace(model, loss_and_metrics, local[0], optimizer=sgd, config=config),
                               mesh, config)[-1]
        ranks = SimulatedRanks(program, MetaInit(model, 3, torch.device("cpu")) if variant == "meta_device" else model,
                               sgd, mesh)
        results.append((ranks.step(local)[0]["loss"], ranks.parameters(3)))
    (loss, params), (ep_loss, ep_params) = results
    tolerance = 1e-3 if variant == "bf16" else 1e-5  # bf16 GEMMs summed in another order
    assert torch.allclose(ep_loss, loss, rtol=tolerance)
    for name, value in params.items():
        assert torch.allclose(ep_params[name], value, rtol=tolerance, atol=tolerance / 10), name


def test_config_capacity_factor_overrides_every_dispatch_and_sizes_the_buffers():
    sgd = fxshard.optim.SGD(lr=0.5)
    local = batches_for(2, 1, rows=2, seq=8, vocab=64)[0]
    results = []
    for model_capacity, config_capacity in ((0.5, None), (None, 0.5)):
        torch.manual_seed(0)
        model = MoEGPT(MoEGPTConfig.preset("tiny", capacity_factor=model_capacity))
        config = fxshard.Config(moe_capacity_factor=config_capacity)
        mesh = fxshard.Mesh(dp=2, ep=2)
        program = run_pipeline(fxshard.trace(model, loss_and_metrics, local[0], optimizer=sgd, config=config),
                               mesh, config)[-1]
        assert "capacity 4/expert, buffer 8 rows" in program.notes["ep"]  # ceil(0.5 * 16 * 2 / 4) = 4
        metrics = SimulatedRanks(program, model, sgd, mesh).step(local)[0]
        results.append((metrics["loss"], metrics["moe_dropped_tokens"]))
    assert results[0][1] > 0 and results[0][1] == results[1][1]
    assert torch.equal(results[0][0], results[1][0])
    with pytest.raises(fxshard.FxShardError, match="moe_capacity_factor"):
        fxshard.Config(moe_capacity_factor=0)
    # inside pipeline stages too: rank = pp * dp + dp index, ep groups of consecutive ranks in a stage
    assert fxshard.Mesh(pp=2, dp=2, ep=2).coords(3) == {"pp": 1, "dp": 1, "ep": 1, "edp": 0}


class ScaledExpertsMoE(torch.nn.Module):
    """A user's MoE block, not MoEGPT's: GELU experts, and each row scaled by its routing weight
    between fc1 and fc2 (inside the expert computation), combined with unit weights."""

    def __init__(self, width=8, hidden=6, experts=4, top_k=2, capacity=None):
        super().__init__()
        from fxshard.models.grouped_linear import GroupedLinear

        self.top_k, self.experts, self.capacity = top_k, experts, capacity
        self.embed = torch.nn.Embedding(16, width)
        self.blocks = torch.nn.ModuleList(torch.nn.ModuleDict({
            "router": torch.nn.Linear(width, experts, bias=False),
            "fc1": GroupedLinear(experts, width, hidden), "fc2": GroupedLinear(experts, hidden, width)})
            for _ in range(2))
        self.head = torch.nn.Linear(width, 16)

    def forward(self, idx):
        from fxshard import moe
        from fxshard.ops import grouped_mm

        x = self.embed(idx).flatten(0, 1)
        for block in self.blocks:
            weights, chosen = torch.softmax(block["router"](x), -1).topk(self.top_k, dim=-1)
            routed = moe.dispatch(x, chosen, self.experts, self.capacity)
            scale = weights.reshape(-1)[routed.order].unsqueeze(-1)
            hidden = torch.nn.functional.gelu(grouped_mm(routed.rows, routed.offsets, block["fc1"].weight_grouped()))
            out = grouped_mm(hidden * scale, routed.offsets, block["fc2"].weight_grouped())
            x = x + moe.combine(out, routed, torch.ones_like(weights), x.shape[0])
        return self.head(x)


@given(capacity=st.sampled_from([None, 1.0]), overlap=st.booleans(), mesh=st.sampled_from([(2, 2), (4, 2)]))
def test_a_users_moe_block_gets_expert_parallelism_too(capacity, overlap, mesh):
    world, ep = mesh
    torch.manual_seed(0)
    model = ScaledExpertsMoE(capacity=capacity)

    def loss_fn(m, batch):
        return torch.nn.functional.cross_entropy(m(batch["idx"]), batch["tgt"].flatten())

    config = fxshard.Config(ep_overlap=overlap, ep_chunks=2, layers=("blocks.*",))
    assert_ep_step_like_the_traced_program(model, loss_fn, world, ep, config)


def test_experts_stored_flat_are_refused_naming_the_parameter_and_the_reshape():
    """Dbrx stores a layer's experts as one [E * F, H] parameter and views it [E, F, H]: its dim 0 is
    not the experts, so ep cannot split it by dim 0; the refusal names the parameter and the reshape."""
    class FlatExperts(ScaledExpertsMoE):
        def __init__(self):
            super().__init__()
            for block in self.blocks:
                block["fc1"].weight_flat = torch.nn.Parameter(block["fc1"].weight_grouped().detach().flatten(0, 1))
                block["fc1"].weight_grouped = lambda fc=block["fc1"]: fc.weight_flat.view(self.experts, -1, 8)
    model = FlatExperts()
    for block in model.blocks:  # the grouped copy stays unread
        for name, param in list(block["fc1"].named_parameters()):
            if name != "weight_flat":
                param.requires_grad_(False)
    traced = fxshard.trace(model, lambda m, b: torch.nn.functional.cross_entropy(m(b["idx"]), b["tgt"].flatten()),
                           {"idx": torch.zeros(1, 4, dtype=torch.long), "tgt": torch.zeros(1, 4, dtype=torch.long)},
                           config=fxshard.Config(layers=("blocks.*",)))
    with pytest.raises(fxshard.FxShardError, match=r"cannot split these expert weights: .* reshapes what it "
                                                   r"reads from blocks\.\d\.fc1\.weight_flat \(24, 8\) into \(4, 6, 8\): "
                                                   r"dim 0 is not the 4 experts"):
        expert_parallel(traced, EPConfig(2))


def test_expert_weights_joined_from_halves_along_another_dim_than_0_are_split():
    """Gate and up halves, each [E, F/2, H], stacked along dim 1: dim 0 stays the experts (as with cat
    along dim 1), so ep splits them; one step matches the traced program."""
    class StackedHalves(ScaledExpertsMoE):
        def __init__(self):
            super().__init__()
            for block in self.blocks:
                fc = block["fc1"]
                whole = fc.weight_grouped().detach()
                fc.a, fc.b = (torch.nn.Parameter(half.clone()) for half in whole.chunk(2, dim=1))
                fc.weight_grouped = lambda fc=fc, shape=whole.shape: torch.stack([fc.a, fc.b], dim=1).reshape(shape)
                for name, param in fc.named_parameters():
                    param.requires_grad_(name in ("a", "b"))

    torch.manual_seed(0)
    config = fxshard.Config(layers=("blocks.*",))
    assert_ep_step_like_the_traced_program(
        StackedHalves(), lambda m, b: torch.nn.functional.cross_entropy(m(b["idx"]), b["tgt"].flatten()), 2, 2, config)


def assert_ep_step_like_the_traced_program(model, loss_fn, world, ep, config):
    """One SGD step under Mesh(dp=world, ep=ep) on the simulator against the traced single-device
    program run on each rank's batch: the mean loss, and parameters updated by the mean gradient."""
    sgd = fxshard.optim.SGD(lr=0.5)
    local = batches_for(world, 1, rows=2, seq=4, vocab=16)[0]
    traced = fxshard.trace(model, loss_fn, local[0], optimizer=sgd, config=config)
    program = run_pipeline(traced, fxshard.Mesh(dp=world, ep=ep), config)[-1]
    assert "ep" in program.notes
    ranks = SimulatedRanks(program, model, sgd, fxshard.Mesh(dp=world, ep=ep))
    loss = ranks.step(local)[0]["loss"]
    singles = [SimulatedRanks(traced, model, sgd, fxshard.Mesh()) for _ in range(world)]
    expected = [s.step([batch])[0]["loss"] for s, batch in zip(singles, local)]
    assert torch.allclose(loss, sum(expected) / world, rtol=1e-5)
    reference = [s.parameters() for s in singles]
    for name, value in ranks.parameters().items():
        assert torch.allclose(value, sum(r[name] for r in reference) / world, rtol=1e-5, atol=1e-6), name


class _HiddenReadOutside(torch.nn.Module):
    """An MoE layer whose hidden activation, relu(h + b) (not zero where h is), also feeds the loss."""

    def __init__(self, capacity, weight_experts=4):
        super().__init__()
        self.capacity = capacity
        self.embed = torch.nn.Embedding(16, 8)
        self.router = torch.nn.Linear(8, 4, bias=False)
        self.w1 = torch.nn.Parameter(torch.randn(weight_experts, 6, 8) * 0.3)
        self.b1 = torch.nn.Parameter(torch.rand(6) + 0.5)
        self.w2 = torch.nn.Parameter(torch.randn(weight_experts, 8, 6) * 0.3)
        self.head = torch.nn.Linear(8, 16)

    def forward(self, idx):
        from fxshard import moe
        from fxshard.ops import grouped_mm

        x = self.embed(idx).flatten(0, 1)
        weights, chosen = torch.softmax(self.router(x), -1).topk(2, dim=-1)
        routed = moe.dispatch(x, chosen, 4, self.capacity, distinct=True)
        hidden = torch.relu(grouped_mm(routed.rows, routed.offsets, self.w1) + self.b1)
        out = grouped_mm(hidden, routed.offsets, self.w2)
        return self.head(x + moe.combine(out, routed, weights, x.shape[0])), hidden.square().mean()

    @staticmethod
    def loss(model, batch):
        logits, penalty = model(batch["idx"])
        return torch.nn.functional.cross_entropy(logits, batch["tgt"].flatten()) + 0.1 * penalty


def test_a_value_of_the_experts_read_outside_them_is_refused_under_a_capacity():
    """Dropped rows hold f(0) on one device and zeros under EP: refused with a capacity, exact without."""
    torch.manual_seed(0)
    assert_ep_step_like_the_traced_program(_HiddenReadOutside(capacity=None), _HiddenReadOutside.loss, 2, 2,
                                           fxshard.Config())
    batch = batches_for(1, 1, rows=2, seq=4, vocab=16)[0][0]
    program = fxshard.trace(_HiddenReadOutside(capacity=0.5), _HiddenReadOutside.loss, batch)
    with pytest.raises(fxshard.FxShardError, match="read outside them. With a capacity"):
        expert_parallel(program, EPConfig(2))
    program = fxshard.trace(_HiddenReadOutside(capacity=None, weight_experts=8), _HiddenReadOutside.loss, batch)
    with pytest.raises(fxshard.FxShardError, match="expert weights for 8 experts, but the layer routes its "
                                                   "tokens among 4"):
        expert_parallel(program, EPConfig(2))


class _SlotExperts(torch.nn.Module):
    """Experts called on the capacity-slot row layout (2 experts x 3 rows), which EP does not rewrite."""

    def __init__(self):
        super().__init__()
        self.w1 = torch.nn.Parameter(torch.randn(2, 8, 4))
        self.w2 = torch.nn.Parameter(torch.randn(2, 4, 4))

    def forward(self, x):
        from fxshard.ops.grouped_mlp import grouped_mlp

        offsets = torch.tensor([2, 5], dtype=torch.int32)
        return grouped_mlp(x, offsets, self.w1, self.w2, capacity=3)


def test_expert_parallelism_refuses_the_capacity_slot_layout():
    program = fxshard.trace(_SlotExperts(), lambda m, b: m(b["x"]).square().mean(), {"x": torch.randn(6, 4)})
    with pytest.raises(fxshard.FxShardError, match="capacity-slot row layout"):
        expert_parallel(program, EPConfig(2))
    model = MoEGPT(MoEGPTConfig.preset("tiny", capacity_factor=1.0, expert_slots=True))
    program = fxshard.trace(model, loss_and_metrics, {"idx": torch.zeros(1, 8, dtype=torch.long),
                                                      "tgt": torch.zeros(1, 8, dtype=torch.long)})
    with pytest.raises(fxshard.FxShardError, match="capacity slots"):
        expert_parallel(program, EPConfig(2))


@given(sizes=st.lists(st.lists(st.integers(0, 6), min_size=3, max_size=3), min_size=1, max_size=4),
       spare=st.integers(0, 5))
def test_received_rows_are_ordered_by_expert_then_source_as_a_sort_would(sizes, spare):
    """receive_order computes each received row's place; an argsort of the (expert, source, place)
    key (padding last) is the reference."""
    counts = torch.tensor(sizes)
    k, experts = counts.shape
    buffer = int(counts.sum(1).max()) + spare
    place = torch.arange(buffer).expand(k, buffer)
    owner = torch.searchsorted(counts.cumsum(1), place.contiguous(), right=True)  # `experts`: padding
    want = torch.argsort(((owner * k + torch.arange(k).unsqueeze(1)) * buffer + place).reshape(-1))
    order, inverse = receive_order(counts, buffer)
    assert torch.equal(order, want)
    assert torch.equal(inverse, moe.inverse_permutation(want))
