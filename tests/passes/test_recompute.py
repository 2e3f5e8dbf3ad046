"""Activation checkpointing (passes/recompute.py): what the backward reads from inside a
torch.utils.checkpoint call is computed again there, and the program computes what it did without."""

import torch
import torch.nn as nn
from hypothesis import given, settings, strategies as st
from torch.utils.checkpoint import checkpoint

import fxshard
from fxshard import meta
from fxshard.dump import peak_live_bytes, saved_activation_bytes
from fxshard.models import GPT, MoEGPT, GPTConfig, MoEGPTConfig
from fxshard.passes import PIPELINE, run_pipeline
from fxshard.passes.recompute import checkpointed_calls, internal, recompute, recomputable
from fxshard.testing import SimulatedRanks, assert_bit_identical, eager_parity
from strategies import local_part, token_batches

ADAMW = fxshard.optim.AdamW(lr=1e-2)


def checkpointed_reads(program) -> list:
    """Backward nodes' reads of recomputable forward values made inside checkpointed calls, other than
    the calls' results."""
    calls = [set(nodes) for nodes in checkpointed_calls(program.graph).values()]
    return [(n.name, u.name) for call in calls for n in call if recomputable(n) and internal(n, call)
            for u in n.users if meta.phase(u) == meta.BWD]


def gpt(n_layer, checkpointed):
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=24, d_model=16, n_layer=n_layer, n_head=2, d_ff=24, checkpoint_layers=checkpointed))


@settings(deadline=None)
@given(n_layer=st.integers(1, 2), microbatches=st.sampled_from([1, 2]))
def test_recomputed_program_computes_the_same_bits_and_saves_less(n_layer, microbatches):
    batches = token_batches(1, 2, local_batch=2, seq=8, vocab=24)
    config = fxshard.Config(microbatches=microbatches)
    traced = fxshard.trace(gpt(n_layer, True), lambda m, b: m.loss(b), batches[0], optimizer=ADAMW, config=config)
    plain = fxshard.trace(gpt(n_layer, False), lambda m, b: m.loss(b), batches[0], optimizer=ADAMW, config=config)
    rewritten = recompute(traced)
    # the marks change nothing by themselves: the traced program reads what the plain one does
    assert checkpointed_reads(traced) and saved_activation_bytes(traced) == saved_activation_bytes(plain)
    assert checkpointed_reads(rewritten) == []
    assert saved_activation_bytes(rewritten) < saved_activation_bytes(traced)
    assert peak_live_bytes(rewritten) <= peak_live_bytes(traced)
    assert "checkpointed calls" in rewritten.notes["recompute"]
    assert_bit_identical([traced, rewritten], gpt(n_layer, True), ADAMW, fxshard.Mesh(), batches[:1])


MESHES = [(fxshard.Mesh(dp=2), "1f1b", "optim_grads_params"), (fxshard.Mesh(pp=2), "zb-h1", "no_shard"),
          (fxshard.Mesh(pp=2), "interleaved-1f1b", "no_shard"), (fxshard.Mesh(pp=2, dp=2), "1f1b", "optim")]


@settings(deadline=None)
@given(case=st.sampled_from(MESHES))
def test_recompute_before_the_pipeline_cut_and_fsdp_changes_no_bit(case):
    """Every stage's program of a checkpointed GPT, with and without the recompute pass, trains the
    same bits on the simulated ranks: the copies land in the backward actions of their chunk."""
    mesh, schedule, sharding = case
    config = fxshard.Config(microbatches=2, schedule=schedule, sharding=sharding,
                            virtual_stages=2 if schedule == "interleaved-1f1b" else 1)
    n_layer = 4 if schedule == "interleaved-1f1b" else 2
    rows = 4  # per rank, two microbatches of 2
    local = [local_part(token_batches(mesh.dp, 1, rows, seq=8, vocab=24, seed=3)[0], d, rows) for d in range(mesh.dp)]
    # a pipeline cuts the program of one microbatch; without one, the program takes the rank's batch
    example = local_part(local[0], 0, rows // 2) if mesh.pp > 1 else local[0]
    traced = fxshard.trace(gpt(n_layer, True), lambda m, b: m.loss(b), example, optimizer=ADAMW,
                           config=None if mesh.pp > 1 else config)
    without = [p for p in PIPELINE if p.name != "recompute"]
    stages = [[run_pipeline(traced, mesh, config, pipeline=passes, stage=s)[-1] for s in range(mesh.pp)]
              for passes in (PIPELINE, without)]
    assert all(checkpointed_reads(p) == [] for p in stages[0]) and all(checkpointed_reads(p) for p in stages[1])
    assert_bit_identical(stages, gpt(n_layer, True), ADAMW, mesh,
                         [local[mesh.coords(r)["dp"]] for r in range(mesh.size)])


class Pairs(GPT):
    """Layers 1 and 2 in one checkpointed call, which a pipeline cut at (2, 2) splits."""

    def forward(self, idx):
        from fxshard.models.blocks import rope_tables

        x = self.tok_emb(idx)
        cos, sin = rope_tables(idx.shape[1], self.cfg.d_model // self.cfg.n_head, self.cfg.rope_theta, idx.device)
        x = self.layers[0](x, cos, sin)
        x = checkpoint(lambda h: self.layers[2](self.layers[1](h, cos, sin), cos, sin), x, use_reentrant=False)
        return self.head(self.norm(self.layers[3](x, cos, sin)))


def test_a_call_over_two_layers_that_the_pipeline_cuts_is_recomputed_layer_by_layer():
    torch.manual_seed(0)
    model = Pairs(GPTConfig(vocab_size=24, d_model=16, n_layer=4, n_head=2, d_ff=24))
    mesh, config = fxshard.Mesh(pp=2), fxshard.Config(microbatches=2, stage_layers=(2, 2))
    batch = token_batches(1, 1, 4, seq=8, vocab=24, seed=3)[0]
    traced = fxshard.trace(model, lambda m, b: m.loss(b), local_part(batch, 0, 2), optimizer=ADAMW)
    without = [p for p in PIPELINE if p.name != "recompute"]
    stages = [[run_pipeline(traced, mesh, config, pipeline=passes, stage=s)[-1] for s in range(2)]
              for passes in (PIPELINE, without)]
    assert all("recompute" in p.notes for p in stages[0])  # both stages' layers of the call
    assert_bit_identical(stages, model, ADAMW, mesh, [batch, batch])


def test_a_checkpoint_inside_a_checkpointed_call_leaves_the_outer_call_marked():
    class Nested(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.out = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 1)

        def outer(self, x):
            h = checkpoint(lambda y: torch.tanh(self.b(y)), torch.tanh(self.a(x)), use_reentrant=False)
            return torch.sigmoid(h) * 3.0  # after the inner call: still the outer call's

        def forward(self, x):
            return self.out(checkpoint(self.outer, x, use_reentrant=False))

    program = fxshard.trace(Nested(), regression_loss, {"x": torch.randn(4, 4), "y": torch.randn(4, 1)})
    forward = [n for n in program.graph.nodes if meta.phase(n) == meta.FWD]
    outer_linear, inner_linear, _ = [n.meta.get(meta.RECOMPUTE) for n in forward if n.target is torch.ops.aten.addmm.default]
    after_inner = next(n.meta.get(meta.RECOMPUTE) for n in forward if n.target is torch.ops.aten.sigmoid.default)
    assert None not in (outer_linear, inner_linear) and outer_linear != inner_linear and after_inner == outer_linear


def test_moe_blocks_under_checkpoint_keep_their_dispatch_and_change_no_bit_under_expert_parallelism():
    """MoEGPTConfig(checkpoint_layers) at Mesh(dp=2, ep=2): the all-to-alls and fxshard's MoE ops are
    read where the forward made them, the rest of each block computed again."""
    def model():
        torch.manual_seed(0)
        return MoEGPT(MoEGPTConfig.preset("tiny", n_layer=2, checkpoint_layers=True))

    mesh, config = fxshard.Mesh(dp=2, ep=2), fxshard.Config()
    local = token_batches(2, 1, local_batch=4, seq=8)[0]
    local = [local_part(local, rank, 4) for rank in range(2)]
    traced = fxshard.trace(model(), lambda m, b: m.loss_and_metrics(b), local[0], optimizer=ADAMW, config=config)
    without = [p for p in PIPELINE if p.name != "recompute"]
    programs = [run_pipeline(traced, mesh, config, pipeline=passes)[-1] for passes in (PIPELINE, without)]
    assert "recompute" in programs[0].notes and checkpointed_reads(programs[0]) == []
    assert not any(n.name.startswith("recompute_") and n.target in meta.COLLECTIVE_ISSUES
                   for n in programs[0].graph.nodes)
    assert saved_activation_bytes(programs[0]) < saved_activation_bytes(programs[1])
    assert_bit_identical(programs, model(), ADAMW, mesh, local)


class Noisy(nn.Module):
    """A block with batch norm and dropout inside a checkpoint (reentrant or not): the random draw is
    read where the forward made it (drawn again it would differ), the rest computed again."""

    def __init__(self, reentrant=True, p=0.5):
        super().__init__()
        # no biases before the batch norm: it cancels them, and AdamW would blow their ~0 gradients up
        self.pre, self.inp, self.norm = nn.Linear(6, 6, bias=False), nn.Linear(6, 12, bias=False), nn.BatchNorm1d(12)
        self.out, self.drop, self.reentrant = nn.Linear(12, 1), nn.Dropout(p), reentrant

    def block(self, x):
        return torch.tanh(self.drop(self.norm(self.inp(x))))

    def forward(self, x):  # (eager reentrant checkpoint needs an input that requires grad: self.pre's)
        return self.out(checkpoint(self.block, self.pre(x), use_reentrant=self.reentrant))


def regression_loss(model, batch):
    return ((model(batch["x"]) - batch["y"]) ** 2).mean()


def test_both_checkpoint_implementations_train_like_eager_and_no_random_draw_is_repeated():
    torch.manual_seed(0)
    batches = [{"x": torch.randn(8, 6), "y": torch.randn(8, 1)} for _ in range(3)]
    torch.manual_seed(0)
    program = fxshard.trace(Noisy(), regression_loss, batches[0], optimizer=ADAMW)
    rewritten = recompute(program)
    random = [n for n in rewritten.graph.nodes if n.op == "call_function" and
              torch.Tag.nondeterministic_seeded in getattr(n.target, "tags", ())]
    assert random and all(meta.phase(n) == meta.FWD for n in random)  # drawn once, read by the backward
    assert checkpointed_reads(rewritten) == [] and "recompute" in rewritten.notes
    results = []
    for each in (program, rewritten):  # the same draws: each run from the same RNG state
        torch.manual_seed(1)
        ranks = SimulatedRanks(each, Noisy(), ADAMW, fxshard.Mesh())
        results.append(([ranks.step(batches[:1])[0]["loss"] for _ in range(2)], ranks.parameters()))
    (losses, params), (other_losses, other_params) = results
    assert all(torch.equal(a, b) for a, b in zip(losses, other_losses)) and losses[0] != losses[1]
    assert all(torch.equal(params[name], other_params[name]) for name in params)
    for reentrant in (True, False):  # without dropout, eager torch's own checkpoint is the reference
        torch.manual_seed(0)
        parity = eager_parity(Noisy(reentrant, p=0.0), regression_loss, batches, ADAMW)
        assert parity.max_loss_rel < 1e-6 and parity.max_param_rel < 1e-5, parity


def test_hugging_face_gradient_checkpointing_is_applied():
    transformers = __import__("pytest").importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids.clone()}

    def loss(m, b):
        return m(**b, use_cache=False).loss

    saved = {}
    for enabled in (False, True):
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config)
        if enabled:  # transformers' newer name, else its older one
            (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
        model.train()
        programs = run_pipeline(fxshard.trace(model, loss, batch, optimizer=ADAMW), None, fxshard.Config())
        saved[enabled] = saved_activation_bytes(programs[-1])
        assert ("recompute" in [p.name for p in programs]) == enabled
    assert saved[True] < saved[False] / 2, saved


def test_a_selective_policy_keeps_what_it_saves_and_trains_like_eager_selective_checkpointing():
    """GPTConfig(checkpoint_layers="selective") (torch's create_selective_checkpoint_contexts keeping
    matmul and attention outputs): those are read where the forward made them, the rest computed
    again; the program changes no bit and trains as eager PyTorch's selective checkpoint does."""
    from fxshard.models.blocks import SAVED_BY_SELECTIVE

    batches = token_batches(1, 3, local_batch=2, seq=8, vocab=24)
    saved = {}
    for mode in (False, True, "selective"):
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=24, d_model=16, n_layer=2, n_head=2, d_ff=24, checkpoint_layers=mode))
        traced = fxshard.trace(model, lambda m, b: m.loss(b), batches[0], optimizer=ADAMW)
        rewritten = recompute(traced)
        saved[mode] = saved_activation_bytes(rewritten)
        if mode == "selective":
            copies = {n.target for n in rewritten.graph.nodes if n.name.startswith("recompute_")}
            assert copies and not copies & set(SAVED_BY_SELECTIVE)
            assert "kept by selective policies" in rewritten.notes["recompute"]
            assert_bit_identical([traced, rewritten], model, ADAMW, fxshard.Mesh(), batches[:1])
            parity = eager_parity(model, lambda m, b: m.loss(b), batches, ADAMW)
            assert parity.max_loss_rel < 1e-6 and parity.max_param_rel < 1e-5, parity
    assert saved[True] < saved["selective"] < saved[False], saved


def test_a_counting_policy_is_asked_in_forward_order_and_composable_checkpoint_is_applied():
    """A policy that keeps every other matmul (torchtitan's op-level rule) keeps the second of each
    call's two, as eager PyTorch would; torch.distributed._composable.checkpoint marks its module's
    calls like torch.utils.checkpoint (it binds torch's generator at import)."""
    from functools import partial

    from torch.distributed._composable import checkpoint as composable_checkpoint
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    def every_other_matmul(counts, ctx, op, *args, **kwargs):
        if op is torch.ops.aten.mm.default:
            counts["mm"] += 1
            if counts["mm"] % 2 == 0:
                return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    class Mlp(nn.Module):
        def __init__(self, selective):
            super().__init__()
            self.a, self.b, self.selective = nn.Linear(6, 6, bias=False), nn.Linear(6, 1, bias=False), selective

        def block(self, x):
            return torch.tanh(self.b(torch.tanh(self.a(x))))

        def forward(self, x):
            if self.selective:  # a fresh count for each call, as context_fn is called once per call
                context = lambda: create_selective_checkpoint_contexts(partial(every_other_matmul, {"mm": 0}))
                return checkpoint(self.block, x, use_reentrant=False, context_fn=context)
            return self.block(x)

    torch.manual_seed(0)
    batch = {"x": torch.randn(4, 6), "y": torch.randn(4, 1)}
    program = fxshard.trace(Mlp(True), regression_loss, batch, optimizer=ADAMW)
    matmuls = [n for n in program.graph.nodes if meta.phase(n) == meta.FWD and n.target is torch.ops.aten.mm.default]
    assert [bool(n.meta.get(meta.SAVED)) for n in matmuls] == [False, True]

    class Nested(Mlp):  # the outer call's policy is asked about the inner (fully checkpointed) call's ops too
        def forward(self, x):
            inner = lambda h: checkpoint(lambda y: torch.tanh(self.b(y)), h, use_reentrant=False)
            keep_matmuls = lambda: create_selective_checkpoint_contexts([torch.ops.aten.mm.default])
            return checkpoint(lambda y: inner(torch.tanh(self.a(y))), x, use_reentrant=False, context_fn=keep_matmuls)

    program = fxshard.trace(Nested(False), regression_loss, batch, optimizer=ADAMW)
    matmuls = [n for n in program.graph.nodes if meta.phase(n) == meta.FWD and n.target is torch.ops.aten.mm.default]
    assert len(matmuls) == 2 and all(n.meta.get(meta.SAVED) for n in matmuls)
    assert len({n.meta[meta.RECOMPUTE] for n in matmuls}) == 2  # each in its own call

    class Composable(nn.Module):
        def __init__(self):
            super().__init__()
            self.pre, self.inner = nn.Linear(6, 6), composable_checkpoint(Mlp(False))

        def forward(self, x):
            return self.inner(self.pre(x))

    torch.manual_seed(0)
    rewritten = recompute(fxshard.trace(Composable(), regression_loss, batch, optimizer=ADAMW))
    assert "recompute" in rewritten.notes and checkpointed_reads(rewritten) == []
    torch.manual_seed(0)
    parity = eager_parity(Composable(), regression_loss, [batch, batch], ADAMW)
    assert parity.max_loss_rel < 1e-6 and parity.max_param_rel < 1e-5, parity
