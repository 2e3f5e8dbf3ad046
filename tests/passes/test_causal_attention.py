"""The causal_attention pass: a constant causal attention mask becomes is_causal, the function stays."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, strategies as st

import fxshard
from fxshard.graph import call_argument
from fxshard.passes import run_pipeline
from fxshard.passes.causal_attention import ATTENTION_MASKS, causal_attention
from fxshard.testing import SimulatedRanks, relative


class MaskedAttention(nn.Module):
    """One attention layer that builds its own mask: "causal" (boolean), "additive" (0 / -inf, as
    many libraries write it), "window" (causal within 2 keys: not the causal pattern) or "padding"
    (causal and the batch's padding: reads an input)."""

    def __init__(self, kind: str, width: int = 16, heads: int = 2):
        super().__init__()
        self.kind, self.heads = kind, heads
        self.embed = nn.Embedding(32, width)
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, 32)

    def forward(self, idx, keep):
        x = self.embed(idx)
        rows, length = idx.shape
        q, k, v = (t.view(rows, length, self.heads, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        positions = torch.arange(length, device=idx.device)
        allowed = positions[None, :] <= positions[:, None]
        if self.kind == "window":
            allowed = allowed & (positions[:, None] - positions[None, :] < 2)
        mask = allowed.expand(rows, 1, length, length)
        if self.kind == "padding":
            mask = mask & keep[:, None, None, :].bool()
        if self.kind == "additive":
            mask = torch.zeros(length, length, device=idx.device).masked_fill(~allowed, float("-inf"))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out(y.transpose(1, 2).reshape(rows, length, -1))


def loss_fn(model, batch):
    return F.cross_entropy(model(batch["idx"], batch["keep"]).flatten(0, 1), batch["tgt"].flatten())


def masked_calls(program):
    return [n for n in program.graph.nodes if n.op == "call_function" and n.target in ATTENTION_MASKS
            and isinstance(call_argument(n, ATTENTION_MASKS[n.target]), torch.fx.Node)]


@given(kind=st.sampled_from(["causal", "additive", "window", "padding"]), rows=st.integers(1, 3),
       length=st.integers(2, 9))
def test_a_causal_mask_becomes_is_causal_and_the_step_computes_the_same(kind, rows, length):
    torch.manual_seed(0)
    model = MaskedAttention(kind)
    generator = torch.Generator().manual_seed(1)
    keep = torch.ones(rows, length, dtype=torch.long)
    keep[0, -1] = 0  # the first row ends in padding (read only by the "padding" mask)
    batch = {"idx": torch.randint(0, 32, (rows, length), generator=generator),
             "tgt": torch.randint(0, 32, (rows, length), generator=generator), "keep": keep}
    optimizer = fxshard.optim.SGD(lr=0.5)
    traced = fxshard.trace(model, loss_fn, batch, optimizer=optimizer)
    rewritten = causal_attention(traced)
    calls = [n for n in traced.graph.nodes if n.op == "call_function" and n.target in ATTENTION_MASKS]
    assert len(calls) == 2  # forward and backward
    if kind in ("causal", "additive") or kind == "window" and length <= 2:  # a 2-key window over 2 keys: causal
        assert not masked_calls(rewritten) and "2 attention calls" in rewritten.notes["causal_attention"]
    else:
        assert rewritten is traced  # not the causal pattern, or it reads the batch
    results = []
    for program in (traced, rewritten):
        ranks = SimulatedRanks(program, model, optimizer, fxshard.Mesh(dp=1))
        results.append((ranks.step([batch])[0]["loss"], ranks.parameters()))
    (loss, params), (new_loss, new_params) = results
    assert relative(new_loss, loss) < 1e-6
    for name, value in params.items():
        assert relative(new_params[name], value) < 1e-6, name


def test_transformers_llama_without_padding_runs_causal_attention():
    """transformers keeps its mask while traced; with no padding the mask is the causal pattern."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    model = transformers.LlamaForCausalLM(config)
    batch = {"input_ids": torch.randint(0, 64, (2, 8))}
    traced = fxshard.trace(model, lambda m, b: m(**b, labels=b["input_ids"], use_cache=False).loss, batch)
    programs = run_pipeline(traced, None, fxshard.Config())
    assert [p.name for p in programs] == ["traced", "causal_attention"]
    assert len(masked_calls(programs[0])) == 4 and not masked_calls(programs[-1])
