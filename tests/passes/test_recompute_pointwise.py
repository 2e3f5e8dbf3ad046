"""passes/recompute_pointwise.py: what the backward reads and pointwise ops, views and casts make is
computed again in the backward where a minimum cut keeps fewer bytes; the program computes the same
bits, and each copy runs in the backward of its own layer and microbatch."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

import fxshard
from fxshard import meta
from fxshard.codegen import _laid_out
from fxshard.dump import peak_live_bytes, saved_activation_bytes
from fxshard.errors import FxShardError
from fxshard.models import GPT, GPTConfig
from fxshard.passes import PIPELINE, run_pipeline
from fxshard.passes.recompute_pointwise import recompute_pointwise
from fxshard.testing import assert_bit_identical
from strategies import local_part, token_batches

ADAMW = fxshard.optim.AdamW(lr=1e-2)
VOCAB = 24


class RMSNorm(nn.Module):
    """transformers' Llama RMSNorm: normalized in fp32, scaled in the input's dtype."""

    def __init__(self, width):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.weight * h.to(x.dtype)


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.norm, self.up, self.gate, self.down = RMSNorm(width), nn.Linear(width, 2 * width), \
            nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x):
        h = self.norm(x)
        return x + self.down(F.gelu(self.gate(h), approximate="tanh") * self.up(h))


class Model(nn.Module):
    def __init__(self, layers, width=16):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.layers = nn.ModuleList(Block(width) for _ in range(layers))
        self.norm, self.head = RMSNorm(width), nn.Linear(width, VOCAB)

    def forward(self, idx):
        x = self.embed(idx)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def loss_fn(model, batch):
    return F.cross_entropy(model(batch["idx"]).float().flatten(0, 1), batch["tgt"].flatten())


def copies_stay_in_their_layer(program) -> bool:
    """Every copy is a backward node of its original's layer and microbatch, and so is each reader."""
    copies = [n for n in program.graph.nodes if n.name.startswith("recompute_")]
    return bool(copies) and all(
        meta.phase(n) == meta.BWD and all((meta.layer(u), meta.microbatch(u)) == (meta.layer(n), meta.microbatch(n))
                                          for u in n.users) for n in copies)


@settings(deadline=None)
@given(layers=st.integers(1, 2), microbatches=st.sampled_from([1, 2]), dtype=st.sampled_from([None, torch.bfloat16]),
       seed=st.integers(0, 3))
def test_the_step_computes_the_same_bits_and_the_backward_reads_fewer_bytes(layers, microbatches, dtype, seed):
    torch.manual_seed(seed)
    model = Model(layers)
    batches = token_batches(1, 2, local_batch=2, seq=8, vocab=VOCAB, seed=seed)
    config = fxshard.Config(microbatches=microbatches, param_dtype=dtype)
    traced = fxshard.trace(model, loss_fn, batches[0], optimizer=ADAMW, config=config)
    rewritten = recompute_pointwise(traced)
    # each norm's fp32 input and normalized product, and each gelu, come back from smaller values
    assert saved_activation_bytes(rewritten) < saved_activation_bytes(traced)
    assert copies_stay_in_their_layer(rewritten)
    assert "of forward values instead of" in rewritten.notes["recompute_pointwise"]
    assert_bit_identical([traced, rewritten], model, ADAMW, fxshard.Mesh(), batches[:1])


def test_a_program_whose_backward_reads_nothing_cheap_is_handed_back():
    program = fxshard.trace(nn.Linear(4, 1), lambda m, b: F.mse_loss(m(b["x"]), b["y"]),
                            {"x": torch.randn(4, 4), "y": torch.randn(4, 1)})
    assert recompute_pointwise(program) is program


MESHES = [(fxshard.Mesh(dp=2), "1f1b", "optim_grads_params"), (fxshard.Mesh(pp=2), "zb-h1", "no_shard"),
          (fxshard.Mesh(pp=2), "interleaved-1f1b", "no_shard"), (fxshard.Mesh(pp=2, dp=2), "1f1b", "optim")]


@settings(deadline=None)
@given(case=st.sampled_from(MESHES))
def test_copies_before_the_pipeline_cut_and_fsdp_change_no_bit(case):
    """Every stage's program of a GPT with and without the pass trains the same bits on the simulated
    ranks: each copy lands in the backward action of its chunk."""
    mesh, schedule, sharding = case
    config = fxshard.Config(microbatches=2, schedule=schedule, sharding=sharding, recompute_pointwise=True,
                            virtual_stages=2 if schedule == "interleaved-1f1b" else 1)
    n_layer = 4 if schedule == "interleaved-1f1b" else 2
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=VOCAB, d_model=16, n_layer=n_layer, n_head=2, d_ff=24))
    rows = 4  # per rank, two microbatches of 2
    local = [local_part(token_batches(mesh.dp, 1, rows, seq=8, vocab=VOCAB, seed=3)[0], d, rows)
             for d in range(mesh.dp)]
    example = local_part(local[0], 0, rows // 2) if mesh.pp > 1 else local[0]
    traced = fxshard.trace(model, lambda m, b: m.loss(b), example, optimizer=ADAMW,
                           config=None if mesh.pp > 1 else config)
    without = [p for p in PIPELINE if p.name != "recompute_pointwise"]
    stages = [[run_pipeline(traced, mesh, config, pipeline=passes, stage=s)[-1] for s in range(mesh.pp)]
              for passes in (PIPELINE, without)]
    assert all(copies_stay_in_their_layer(p) for p in stages[0])
    assert_bit_identical(stages, model, ADAMW, mesh, [local[mesh.coords(r)["dp"]] for r in range(mesh.size)])


def test_it_runs_where_the_step_is_compiled_unless_told_in_shard_check_and_the_pass_list_alike():
    batch = {"idx": torch.randint(0, VOCAB, (2, 8)), "tgt": torch.randint(0, VOCAB, (2, 8))}
    traced = fxshard.trace(Model(1), loss_fn, batch, optimizer=ADAMW)
    names = {(setting, codegen): [p.name for p in run_pipeline(traced, None, fxshard.Config(
        recompute_pointwise=setting, codegen=codegen))] for setting in (None, True, False) for codegen in (None, "inductor")}
    assert {key for key, passes in names.items() if "recompute_pointwise" in passes} == {
        (None, "inductor"), (True, None), (True, "inductor")}  # on CPU, "auto" codegen is off
    step = fxshard.shard(Model(1), loss_fn, batch, optimizer=ADAMW, config=fxshard.Config(recompute_pointwise=True))
    assert "recompute_pointwise" in step.program.notes
    with pytest.raises(FxShardError, match="recompute_pointwise='yes'"):
        fxshard.Config(recompute_pointwise="yes")


class Unlisted(Model):
    """The same blocks as plain attributes, not in a ModuleList: every node's layer is "pre"."""

    def __init__(self, layers, width=16):
        super().__init__(layers, width)
        blocks = list(self.layers)
        del self.layers
        for i, block in enumerate(blocks):
            setattr(self, f"block{i}", block)
        self.count = len(blocks)

    def forward(self, idx):
        x = self.embed(idx)
        for i in range(self.count):
            x = getattr(self, f"block{i}")(x)
        return self.head(self.norm(x))


@pytest.mark.parametrize("cls", [Model, Unlisted])
def test_the_peak_drops_however_the_model_names_its_layers(cls):
    """Each copy is made just before the backward first reads it: blocks that share one layer name do
    not bring all their values back at once."""
    torch.manual_seed(0)
    model = cls(4, width=32)
    batch = {"idx": torch.randint(0, VOCAB, (16, 32)), "tgt": torch.randint(0, VOCAB, (16, 32))}
    traced = fxshard.trace(model, loss_fn, batch, optimizer=fxshard.optim.SGD(lr=0.1))
    rewritten = recompute_pointwise(traced)
    assert peak_live_bytes(rewritten) < 0.85 * peak_live_bytes(traced)


def test_a_compiled_region_hands_an_expanded_output_back_in_its_traced_layout():
    """An output the traced program has as an expanded view (stride 0, as the pass may keep one) and
    Inductor returns laid out otherwise is copied into that layout: its values at index 0, expanded."""
    value = torch.arange(6.0).reshape(2, 1, 3).expand(2, 4, 3).contiguous()
    laid = _laid_out(value, (2, 4, 3), (3, 0, 1))
    assert laid.stride() == (3, 0, 1) and torch.equal(laid, value)
