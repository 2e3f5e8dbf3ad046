"""MoE layers written elsewhere get expert parallelism (passes/recognize_moe.py): transformers'
experts and a torchtitan-style MoE train under Mesh(dp, ep) like their un-rewritten program, and
look-alikes that would be wrong to split are refused with the reason."""

import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

import fxshard
from fxshard.passes import run_pipeline
from fxshard.passes.fsdp import STRATEGIES
from fxshard.testing import SimulatedRanks, eager_parity

SGD = fxshard.optim.SGD(lr=0.5)
ADAMW = fxshard.optim.AdamW(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


class TitanMoE(nn.Module):
    """torchtitan's MoE (models/moe/moe.py) as it computes, in fp32, without the alignment padding of
    its grouped GEMM: a softmax/sigmoid top-k router, histc counts, a stable argsort, a gather of the
    tokens by sorted index // k, scores applied before or after the experts, three grouped GEMMs,
    an optional shared expert, and a scatter_add combine. `counting="one_hot"` counts as torchtitan
    0.3.0 does: the sum over tokens of a routing map with True scattered at the chosen experts.
    `variant` breaks one link on purpose."""

    def __init__(self, dim, hidden, experts, top_k, score_before=True, shared=True, variant=None, counting="histc"):
        super().__init__()
        self.experts, self.top_k, self.score_before, self.variant = experts, top_k, score_before, variant
        self.counting = counting
        # "null_expert": a router over E + 1 columns, the last one a null expert that histc counts as E - 1
        self.gate = nn.Linear(dim, experts + (variant == "null_expert"), bias=False)
        if variant == "dropped":  # a shared bias after the first expert GEMM, also read outside the experts
            self.b1 = nn.Parameter(torch.randn(hidden) * 0.5)
        if variant == "other_key":  # a second router, frozen: only its choice is read
            self.other_gate = nn.Linear(dim, experts, bias=False).requires_grad_(False)
        self.w1 = nn.Parameter(torch.randn(experts, hidden, dim) * dim ** -0.5)
        self.w2 = nn.Parameter(torch.randn(experts, dim, hidden) * hidden ** -0.5)
        self.w3 = nn.Parameter(torch.randn(experts, hidden, dim) * dim ** -0.5)
        self.shared = nn.Sequential(nn.Linear(dim, hidden, bias=False), nn.SiLU(),
                                    nn.Linear(hidden, dim, bias=False)) if shared else None
        self.register_buffer("tokens_per_expert", torch.zeros(experts), persistent=False)

    def forward(self, x):
        bs, slen, dim = x.shape
        x = x.view(-1, dim)
        scores = F.softmax(self.gate(x).float(), dim=1)
        top_scores, ids = torch.topk(scores, k=self.top_k, dim=1)
        if self.variant == "hashed":  # expert ids that no top-k chose
            ids = (torch.arange(ids.numel()).view_as(ids) * 7 // 3) % self.experts
        if self.variant == "repeated":  # each token names its first expert k times (as sampled ids may)
            ids = torch.stack([ids[:, 0]] * self.top_k, dim=1)
        if self.variant == "dropped":  # low-scoring assignments dropped by hand: id E, which histc below skips
            ids = torch.where(top_scores < top_scores.mean(), self.experts, ids)
        counted = ids
        if self.variant == "other_key":  # counts from another router's choice than the rows' sort
            counted = torch.topk(self.other_gate(x), k=self.top_k, dim=1).indices
        if self.counting == "one_hot":
            counts = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, counted, True).sum(dim=0)
        else:
            top = self.experts - 1 if self.variant == "dropped" else self.experts
            flat = counted.view(-1).bool() if self.variant == "lossy_cast" else counted.view(-1)  # ids -> 0/1
            counts = torch.histc(flat.float(), bins=self.experts, min=0, max=top)
        if self.variant == "weighted_map":  # a map of twos: each count doubled
            counts = torch.zeros_like(scores).scatter_(-1, counted, 2.0).sum(dim=0)
        with torch.no_grad():
            self.tokens_per_expert.add_(counts)
        order = torch.argsort(ids.view(-1), stable=True)
        sorted_scores = top_scores.view(-1)[order]
        token_of_row = (order // self.top_k).reshape(-1, 1).expand(-1, dim)
        rows = torch.gather(x, 0, token_of_row)
        if self.variant == "unsorted":  # rows in token order while the offsets assume expert order
            rows = x.repeat_interleave(self.top_k, dim=0)
        if self.variant == "sentinel":  # transformers 5.17 masks rows whose sorted id is out of range
            rows = rows.masked_fill((torch.sort(ids.view(-1), stable=True).values >= self.experts).unsqueeze(-1), 0.0)
        if self.score_before:
            rows = rows * sorted_scores.reshape(-1, 1)
        offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
        if self.variant == "counts":  # group sizes where cumulative ends belong
            offsets = counts.to(torch.int32)
        h = torch._grouped_mm(rows, self.w1.transpose(-2, -1), offs=offsets)
        if self.variant == "dropped":
            h = h + self.b1
            penalty = h.pow(2).mean()
        h = F.silu(h)
        h = h * torch._grouped_mm(rows, self.w3.transpose(-2, -1), offs=offsets)
        out_rows = torch._grouped_mm(h, self.w2.transpose(-2, -1), offs=offsets)
        if not self.score_before:
            out_rows = out_rows * sorted_scores.reshape(-1, 1)
        out = self.shared(x) if self.shared is not None else torch.zeros_like(x)
        out = out.scatter_add(0, token_of_row, out_rows)
        if self.variant == "dropped":
            out = out + 1e-2 * penalty
        return out.view(bs, slen, dim)


class TitanBlock(nn.Module):
    def __init__(self, dim, **moe):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.moe = TitanMoE(dim, 8, **moe)

    def forward(self, h):
        return h + self.moe(self.norm(h))


class TitanStyleMoEModel(nn.Module):
    def __init__(self, vocab=32, dim=16, layers=2, **moe):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleDict({str(i): TitanBlock(dim, **moe) for i in range(layers)})
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, batch):
        h = self.tok_embeddings(batch["idx"])
        for layer in self.layers.values():
            h = layer(h)
        return F.cross_entropy(self.output(h).flatten(0, 1), batch["tgt"].flatten())


def local_batches(world, vocab, rows=2, seq=8, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [{"idx": torch.randint(0, vocab, (rows, seq), generator=generator),
             "tgt": torch.randint(0, vocab, (rows, seq), generator=generator)} for _ in range(world)]


def assert_ep_trains_like_one_device(model, loss_fn, local, mesh, config=fxshard.Config(), recognized_layers=2):
    """One SGD step under `mesh`: every rank's loss is the mean of the un-rewritten program's losses on
    the ranks' batches and every parameter the mean of its updates (as tests/passes/test_ep.py).
    `recognized_layers`: how many MoE layers passes/recognize_moe.py had to recognize."""
    traced = fxshard.trace(model, loss_fn, local[0], optimizer=SGD, config=config)
    programs = run_pipeline(traced, mesh, config)
    recognized = next(p for p in programs if p.name == "recognize_moe")
    assert len(recognized.notes["moe_recognized"]) == recognized_layers, recognized.notes
    assert any(n.target is torch.ops._c10d_functional.all_to_all_single.default for n in programs[-1].graph.nodes)
    ranks = SimulatedRanks(programs[-1], model, SGD, mesh)
    metrics = ranks.step(local)
    singles = [SimulatedRanks(traced, model, SGD, fxshard.Mesh()) for _ in local]
    expected = [single.step([batch])[0] for single, batch in zip(singles, local)]
    mean_loss = sum(e["loss"] for e in expected) / len(local)
    for rank_metrics in metrics:
        assert torch.allclose(rank_metrics["loss"], mean_loss, rtol=1e-5, atol=1e-7)
    reference = [single.parameters() for single in singles]
    for rank in range(len(local)):
        params = ranks.parameters(rank)
        for name in reference[0]:
            mean = sum(r[name] for r in reference) / len(local)
            assert torch.allclose(params[name], mean, rtol=1e-5, atol=1e-6), (name, rank)
    return programs


def transformers_moe(architecture, implementation):
    transformers = pytest.importorskip("transformers")
    config = getattr(transformers, f"{architecture}Config")(
        vocab_size=64, hidden_size=32, intermediate_size=16, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, head_dim=8, num_local_experts=4, num_experts=4,
        num_experts_per_tok=2, experts_implementation=implementation)
    torch.manual_seed(0)
    model = getattr(transformers, f"{architecture}ForCausalLM")(config)
    assert model.config._experts_implementation == implementation
    return model


def hf_loss(model, batch):
    return F.cross_entropy(model(batch["idx"]).logits.flatten(0, 1), batch["tgt"].flatten())


@pytest.mark.parametrize("architecture, implementation, fused", [("Qwen3Moe", "grouped_mm", True),
                                                                   ("Mixtral", "batched_mm", False),
                                                                   ("GptOss", "grouped_mm", False)])
def test_transformers_moe_layers_are_recognized_and_split_over_expert_ranks(architecture, implementation, fused):
    """GPT-OSS adds per-expert biases, read at each row's expert (bias[sort(ids).values]): made nonzero
    here, so the split's forward reads them where the rows are."""
    model = transformers_moe(architecture, implementation)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("_bias"):
                param.normal_(generator=torch.Generator().manual_seed(len(name)))
    config = fxshard.Config(fuse_grouped_mlp=fused)
    programs = assert_ep_trains_like_one_device(model, hf_loss, local_batches(2, 64), fxshard.Mesh(dp=2, ep=2), config)
    if fused:  # transformers' gate_up split and SiLU are the fused op's swiglu
        fused_layers = next(p for p in programs if p.name == "fuse_grouped_mlp").notes["fused_grouped_mlp"]
        assert [line.split(":")[0] for line in fused_layers] == ["model.layers.0", "model.layers.1"]


# other transformers MoE families, each routing its own way: DeepSeek-V3 (sigmoid scores, a bias for
# the choice only, group-limited top-k, a shared expert, a dense first layer, MLA attention), Qwen2-MoE
# (a shared expert behind a sigmoid gate), GraniteMoE (its own parallel-experts module)
OTHER_MOE = {
    "DeepseekV3": (dict(intermediate_size=32, moe_intermediate_size=16, n_routed_experts=4, n_shared_experts=1,
                        num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=None,
                        qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, n_group=2, topk_group=1,
                        num_hidden_layers=3), 2),
    "Qwen2Moe": (dict(intermediate_size=32, moe_intermediate_size=16, shared_expert_intermediate_size=16,
                      num_experts=4, num_experts_per_tok=2), 2),
    "GraniteMoe": (dict(intermediate_size=16, num_local_experts=4, num_experts_per_tok=2), 2),
}


@pytest.mark.parametrize("architecture", list(OTHER_MOE))
def test_other_transformers_moe_families_split_over_expert_ranks(architecture):
    transformers = pytest.importorskip("transformers")
    sizes, moe_layers = OTHER_MOE[architecture]
    config = getattr(transformers, f"{architecture}Config")(**{
        "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 4, "attention_dropout": 0.0, **sizes})
    torch.manual_seed(0)
    model = getattr(transformers, f"{architecture}ForCausalLM")(config)
    assert_ep_trains_like_one_device(model, hf_loss, local_batches(2, 64), fxshard.Mesh(dp=2, ep=2),
                                     recognized_layers=moe_layers)


def test_phimoe_whose_routing_is_not_a_topk_splits_over_expert_ranks():
    """PhiMoE picks its two experts by two masked maxima (sampled in training), not a topk: its ids are
    recognized as ids that may repeat an expert. In eval mode its routing is deterministic, so the
    split is compared with one device exactly (in training each rank samples for its own tokens)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.PhimoeConfig(vocab_size=64, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=4, num_local_experts=4,
                                       num_experts_per_tok=2, attention_dropout=0.0)
    torch.manual_seed(0)
    model = transformers.PhimoeForCausalLM(config).eval()
    assert_ep_trains_like_one_device(model, hf_loss, local_batches(2, 64), fxshard.Mesh(dp=2, ep=2))


@pytest.mark.parametrize("implementation", ["eager", "batched_mm"])
def test_transformers_experts_on_other_implementations_trace_as_grouped_mm_and_train_like_eager(implementation):
    """"eager" loops over the experts it finds on the host (untraceable); both trace as transformers'
    grouped_mm experts (fxshard/moe_modules.py) and train like the model running its own code."""
    model = transformers_moe("Qwen3Moe", implementation)
    batches = local_batches(3, 64)
    program = fxshard.trace(model, hf_loss, batches[0])
    assert program.notes["moe_forwards"] == [
        f"model.layers.{i}.mlp.experts: Qwen3MoeExperts, transformers' {implementation!r} experts traced as its "
        f"'grouped_mm' experts (same function)" for i in range(2)]
    parity = eager_parity(model, hf_loss, batches, ADAMW)
    assert parity.max_loss_rel < 1e-5 and parity.max_param_rel < 1e-4, parity.losses
    assert "forward" not in vars(model.model.layers[0].mlp.experts)  # the model's own forward is back


def test_a_custom_transformers_experts_implementation_is_traced_as_written():
    """Only transformers' implementations of grouped_mm's function are swapped for it: one registered by
    the user (ExpertsInterface.register) may compute something else (e.g. weights before the experts)."""
    from fxshard.moe_modules import _transformers_experts

    class Experts(torch.nn.Module):
        _is_expert_parallel = False

        def __init__(self, implementation):
            super().__init__()
            self.config = type("Config", (), {"_experts_implementation": implementation})()
    pytest.importorskip("transformers")
    assert _transformers_experts(Experts("batched_mm")) is not None
    assert _transformers_experts(Experts("eager")) is not None
    for implementation in ("grouped_mm", "scores_before_experts", None):
        assert _transformers_experts(Experts(implementation)) is None



def llama4(top_k):
    transformers = pytest.importorskip("transformers")
    config = transformers.Llama4TextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=16, intermediate_size_mlp=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, head_dim=8, num_local_experts=4, num_experts_per_tok=top_k,
        moe_layers=[0, 1], attention_dropout=0.0)
    torch.manual_seed(0)
    return transformers.Llama4ForCausalLM(config)


def test_llama4_moe_traces_as_its_sparse_layer_trains_like_its_own_forward_and_splits_over_expert_ranks():
    """transformers' Llama 4 MoE runs every expert over every token (bmm); fxshard traces the experts
    each token chose only (fxshard/moe_modules.py): no bmm is left, training matches the model's own
    dense forward, and expert parallelism splits it (before, ep refused the layer)."""
    model = llama4(top_k=1)
    program = fxshard.trace(model, hf_loss, local_batches(1, 64)[0])
    assert [line.split(",")[0] for line in program.notes["moe_forwards"]] == [
        f"model.layers.{i}.feed_forward: Llama4TextMoe" for i in range(2)]
    assert not [n for n in program.graph.nodes if n.target is torch.ops.aten.bmm.default]
    parity = eager_parity(model, hf_loss, local_batches(3, 64), ADAMW)
    assert parity.max_loss_rel < 1e-5 and parity.max_param_rel < 1e-5, parity.losses
    assert "forward" not in vars(model.model.layers[0].feed_forward)
    assert_ep_trains_like_one_device(llama4(top_k=2), hf_loss, local_batches(2, 64), fxshard.Mesh(dp=2, ep=2),
                                     recognized_layers=0)  # moe.dispatch's layers need no recognizing
    fused = run_pipeline(program, None, fxshard.Config(fuse_grouped_mlp=True))[-1]
    assert len(fused.notes["fused_grouped_mlp"]) == 2, fused.notes  # experts stored [E, in, out] fuse too
    with pytest.warns(UserWarning, match=r"fuse_grouped_mlp=True\) fused none of the step's expert MLPs"):
        gpt_oss = transformers_moe("GptOss", "grouped_mm")  # its expert biases keep the unfused form
        fxshard.check(gpt_oss, hf_loss, local_batches(1, 64)[0], config=fxshard.Config(fuse_grouped_mlp=True))
    from fxshard.moe_modules import _llama4
    layer = model.model.layers[0].feed_forward
    layer.__class__ = type("MyMoE", (type(layer),), {})  # a subclass may compute otherwise: traced as written
    assert _llama4(layer) is None

@settings(max_examples=4)
@given(mesh=st.sampled_from([(2, 2), (4, 2), (4, 4)]), experts_per_rank=st.integers(1, 2), top_k=st.integers(1, 3),
       score_before=st.booleans(), shared=st.booleans(), sharding=st.sampled_from(STRATEGIES), overlap=st.booleans(),
       counting=st.sampled_from(["histc", "one_hot"]))
def test_torchtitan_style_moe_is_recognized_and_trains_like_one_device(mesh, experts_per_rank, top_k, score_before,
                                                                      shared, sharding, overlap, counting):
    world, ep = mesh
    experts = ep * experts_per_rank
    torch.manual_seed(0)
    model = TitanStyleMoEModel(experts=experts, top_k=min(top_k, experts), score_before=score_before, shared=shared,
                               counting=counting)
    config = fxshard.Config(sharding=sharding, ep_overlap=overlap)
    assert_ep_trains_like_one_device(model, lambda m, b: m(b), local_batches(world, 32), fxshard.Mesh(dp=world, ep=ep),
                                     config)


def test_counts_summed_from_a_one_hot_routing_map_are_recognized():
    """torchtitan 0.3.0: zeros_like(scores, bool).scatter_(-1, ids, True).sum(tokens) as the counts."""
    torch.manual_seed(0)
    model = TitanStyleMoEModel(experts=4, top_k=2, counting="one_hot", score_before=False)
    assert_ep_trains_like_one_device(model, lambda m, b: m(b), local_batches(2, 32), fxshard.Mesh(dp=2, ep=2))


def test_rows_masked_by_the_sorted_ids_are_still_in_expert_order():
    torch.manual_seed(0)
    model = TitanStyleMoEModel(experts=4, top_k=2, variant="sentinel")
    assert_ep_trains_like_one_device(model, lambda m, b: m(b), local_batches(2, 32), fxshard.Mesh(dp=2, ep=2))


@pytest.mark.parametrize("variant", ["hashed", "repeated", "null_expert"])
def test_expert_ids_not_from_a_topk_are_recognized_and_a_token_may_name_an_expert_twice(variant):
    """Ids chosen otherwise than by a top-k (PhiMoE samples them) are split too, with all-to-all
    buffers sized for a token that reaches one expert k times ("repeated": every token does). So are
    a top-k's over more columns than experts ("null_expert", whose null column histc counts as the
    last expert's: its buffers had been sized for distinct experts, and overflowed)."""
    torch.manual_seed(0)
    model = TitanStyleMoEModel(experts=4, top_k=2, variant=variant)
    programs = assert_ep_trains_like_one_device(model, lambda m, b: m(b), local_batches(2, 32),
                                                fxshard.Mesh(dp=2, ep=2))
    notes = next(p for p in programs if p.name == "recognize_moe").notes["moe_recognized"]
    assert all("may name an expert twice" in line for line in notes), notes


@pytest.mark.parametrize("variant, counting, reason", [
    ("other_key", "histc", "no sort of the flattened expert ids the offsets count orders the rows"),
    ("unsorted", "histc", "not the tokens in the order of the sort"),
    ("repeated", "one_hot", "a token naming an expert twice would be counted once"),
    ("counts", "histc", "not a cumulative sum"),
    ("weighted_map", "histc", "not ones scattered into zeros at the expert ids"),
    ("lossy_cast", "histc", "neither each token's expert ids"),
])
def test_look_alikes_are_not_split_and_the_error_says_why(variant, counting, reason):
    torch.manual_seed(0)
    model = TitanStyleMoEModel(experts=4, top_k=2, variant=variant, counting=counting)
    batch = local_batches(1, 32)[0]
    fxshard.trace(model, lambda m, b: m(b), batch)  # a model fxshard traces on one device
    with pytest.raises(fxshard.FxShardError, match=re.escape(reason)) as error:
        fxshard.check(model, lambda m, b: m(b), batch, mesh=fxshard.Mesh(dp=2, ep=2))
    assert "in layers.0 " in str(error.value) and "fxshard.register_moe" in str(error.value)


def test_rows_of_ids_past_the_experts_read_outside_them_are_refused():
    """Dropped assignments written by hand as the sentinel id E, which histc(max=E-1) does not count:
    their rows belong to no expert, and a value computed there (a bias after the first GEMM, read by a
    penalty outside the experts) is not zero on one device, while expert parallelism returns zeros."""
    torch.manual_seed(0)
    model = TitanStyleMoEModel(experts=4, top_k=2, variant="dropped")
    batch = local_batches(1, 32)[0]
    with pytest.raises(fxshard.FxShardError, match="expert ids are not known to lie below the expert count"):
        fxshard.check(model, lambda m, b: m(b), batch, mesh=fxshard.Mesh(dp=2, ep=2))


class LoopMoE(nn.Module):
    """An MoE whose experts run in a Python loop over the routing read on the host: fxshard cannot trace
    it (the token counts decide the shapes), and registers a forward that computes the same."""

    def __init__(self, dim=16, hidden=8, experts=4, top_k=2):
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(dim, experts, bias=False)
        self.fc1 = nn.Parameter(torch.randn(experts, hidden, dim) * dim ** -0.5)
        self.fc2 = nn.Parameter(torch.randn(experts, dim, hidden) * hidden ** -0.5)

    def route(self, x):
        weights, chosen = torch.topk(F.softmax(self.router(x), dim=-1), self.top_k, dim=-1)
        return weights, chosen

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        weights, chosen = self.route(flat)
        out = torch.zeros_like(flat)
        for expert in chosen.unique().tolist():
            token, slot = torch.where(chosen == expert)
            h = F.gelu(flat[token] @ self.fc1[expert].T) @ self.fc2[expert].T
            out = out.index_add(0, token, h * weights[token, slot, None])
        return out.view_as(x)


def loop_moe_with_fxshard(module, x):
    """LoopMoE's function written with fxshard's primitives."""
    flat = x.reshape(-1, x.shape[-1])
    weights, chosen = module.route(flat)
    routed = fxshard.moe.dispatch(flat, chosen, module.fc1.shape[0])
    h = F.gelu(fxshard.ops.grouped_mm(routed.rows, routed.offsets, module.fc1))
    rows = fxshard.ops.grouped_mm(h, routed.offsets, module.fc2)
    return fxshard.moe.combine(rows, routed, weights, tokens=flat.shape[0]).view_as(x)


class LoopMoEModel(nn.Module):
    def __init__(self, vocab=32, dim=16):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList([LoopMoE(dim), LoopMoE(dim)])
        self.head = nn.Linear(dim, vocab)

    def forward(self, batch):
        h = self.embed(batch["idx"])
        for layer in self.layers:
            h = h + layer(h)
        return F.cross_entropy(self.head(h).flatten(0, 1), batch["tgt"].flatten())


@pytest.fixture
def registered_loop_moe():
    fxshard.register_moe(LoopMoE, loop_moe_with_fxshard)
    yield
    fxshard.register_moe(LoopMoE, None)


def test_an_unrecognizable_moe_trains_through_its_registered_forward(registered_loop_moe):
    torch.manual_seed(0)
    model = LoopMoEModel()
    batches = local_batches(3, 32)
    parity = eager_parity(model, lambda m, b: m(b), batches, ADAMW)  # the eager side runs the loop
    assert parity.max_loss_rel < 1e-5 and parity.max_param_rel < 1e-4, parity.losses
    # fxshard.moe.dispatch wrote the layers' facts: nothing left to recognize
    assert_ep_trains_like_one_device(model, lambda m, b: m(b), local_batches(2, 32), fxshard.Mesh(dp=2, ep=2),
                                     recognized_layers=0)


def test_without_its_registration_the_loop_moe_fails_to_trace_and_bad_registrations_are_refused():
    torch.manual_seed(0)
    with pytest.raises(fxshard.FxShardError, match="output shape depends on tensor values(.|\n)*fxshard.register_moe"):
        fxshard.trace(LoopMoEModel(), lambda m, b: m(b), local_batches(1, 32)[0])
    with pytest.raises(fxshard.FxShardError, match="takes an nn.Module subclass"):
        fxshard.register_moe(LoopMoE(), loop_moe_with_fxshard)
    with pytest.raises(fxshard.FxShardError, match="must be callable"):
        fxshard.register_moe(LoopMoE, "forward")


class HashRoutedMoE(torch.nn.Module):
    """fxshard.moe.dispatch with two hashes of the token id as its experts: a token may name one expert
    twice, which the all-to-all buffers must hold (they used to be sized for distinct experts)."""

    distinct = False

    def __init__(self, dim=16, hidden=8, experts=2):
        super().__init__()
        self.embed, self.head = torch.nn.Embedding(64, dim), torch.nn.Linear(dim, 64)
        self.gate = torch.nn.Linear(dim, experts, bias=False)
        self.fc1 = torch.nn.Parameter(torch.randn(experts, hidden, dim) * dim ** -0.5)
        self.fc2 = torch.nn.Parameter(torch.randn(experts, dim, hidden) * hidden ** -0.5)

    def choose(self, ids):
        return 1 - torch.stack([ids % 2, (ids // 3) % 2], dim=-1)

    def hidden(self, routed, x):
        return F.gelu(fxshard.ops.grouped_mm(routed.rows, routed.offsets, self.fc1))

    def forward(self, batch):
        x = self.embed(batch["idx"]).flatten(0, 1)
        chosen = self.choose(batch["idx"].flatten())
        weights = F.softmax(self.gate(x), -1).gather(1, chosen)
        routed = fxshard.moe.dispatch(x, chosen, self.fc1.shape[0], distinct=self.distinct)
        h = self.hidden(routed, x)
        x = x + fxshard.moe.combine(fxshard.ops.grouped_mm(h, routed.offsets, self.fc2), routed, weights, x.shape[0])
        return F.cross_entropy(self.head(x), batch["tgt"].flatten())


def test_a_dispatch_whose_tokens_name_an_expert_twice_trains_like_one_device():
    batches = local_batches(2, 32)
    repeats = [HashRoutedMoE().choose(b["idx"].flatten()) for b in batches]
    assert all(int((r[:, 0] == r[:, 1]).sum()) > 0 for r in repeats)  # the case under test occurs
    torch.manual_seed(0)
    assert_ep_trains_like_one_device(HashRoutedMoE(), lambda m, b: m(b), batches, fxshard.Mesh(dp=2, ep=2),
                                     fxshard.Config(), recognized_layers=0)  # written with fxshard.moe


class BatchScaledMoE(HashRoutedMoE):
    """Divides the experts' hidden rows by a statistic of this rank's tokens: not a row, not the same on
    every rank, so expert parallelism cannot move it with the rows."""

    distinct = True

    def choose(self, ids):
        return torch.stack([ids % 2, 1 - ids % 2], dim=-1)

    def hidden(self, routed, x):
        return super().hidden(routed, x) / x.detach().abs().mean()


def test_experts_that_read_a_statistic_of_the_ranks_own_batch_are_refused_under_expert_parallelism():
    model = BatchScaledMoE()
    batch = local_batches(1, 32)[0]
    program = fxshard.trace(model, lambda m, b: m(b), batch)
    with pytest.raises(fxshard.FxShardError, match=r"in the experts of MoE layer .* reads .*computed from this rank's "
                                                   r"batch that is not one per row"):
        run_pipeline(program, fxshard.Mesh(dp=2, ep=2), fxshard.Config())
    run_pipeline(program, fxshard.Mesh(dp=2), fxshard.Config())  # data parallelism alone is fine


class InterleavedGateMoE(BatchScaledMoE):
    """GPT-OSS-style gating between the expert GEMMs: gate and linear rows interleaved, h[:, ::2] and
    h[:, 1::2] (their backward is slice_backward along dim 1, row-wise, which the EP pass must know)."""

    def __init__(self):
        super().__init__(hidden=8)
        self.fc1 = torch.nn.Parameter(torch.randn(2, 16, 16) * 0.25)

    def hidden(self, routed, x):
        h = fxshard.ops.grouped_mm(routed.rows, routed.offsets, self.fc1)
        return F.silu(h[:, ::2]) * h[:, 1::2]


def test_interleaved_gating_between_the_expert_gemms_splits_over_expert_ranks():
    torch.manual_seed(0)
    assert_ep_trains_like_one_device(InterleavedGateMoE(), lambda m, b: m(b), local_batches(2, 32),
                                     fxshard.Mesh(dp=2, ep=2), fxshard.Config(), recognized_layers=0)


def test_a_capacity_factor_does_not_apply_to_recognized_layers_and_a_warning_says_so():
    torch.manual_seed(0)
    model = TitanStyleMoEModel(experts=2, top_k=1, score_before=False, shared=False, counting="histc")
    program = fxshard.trace(model, lambda m, b: m(b), local_batches(2, 32)[0])
    with pytest.warns(UserWarning, match=r"moe_capacity_factor=1.0\) bounds fxshard.moe.dispatch calls only; the 2 "
                                         r"MoE layer calls recognized .* stay dropless"):
        run_pipeline(program, fxshard.Mesh(dp=2, ep=2), fxshard.Config(moe_capacity_factor=1.0))
