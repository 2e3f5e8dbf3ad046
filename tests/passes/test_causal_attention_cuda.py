"""The causal_attention pass on CUDA in bf16, where SDPA traces as cuDNN's kernel (Hopper): a causal
mask it is handed (SDPA writes a boolean one as 0 / -65536 for cuDNN) becomes is_causal, and the step
computes what it computed before, up to the kernel's rounding."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, strategies as st
from torch.nn.attention import SDPBackend, sdpa_kernel

import fxshard
from fxshard.graph import call_argument
from fxshard.passes import run_pipeline
from fxshard.passes.causal_attention import ATTENTION_MASKS
from fxshard.testing import SimulatedRanks

pytestmark = pytest.mark.gpu
BF16 = fxshard.Config(param_dtype=torch.bfloat16)
SGD = fxshard.optim.SGD(lr=1.0)  # a step moves each parameter by its gradient: the updates are compared
aten = torch.ops.aten
CUDNN = (aten._scaled_dot_product_cudnn_attention.default, aten._scaled_dot_product_cudnn_attention_backward.default)


class Attention(nn.Module):
    """One attention layer on cuDNN's kernel with a mask it builds itself: causal, or a window (not
    the causal pattern: stays)."""

    def __init__(self, kind, heads, head_dim, vocab=32):
        super().__init__()
        self.kind, self.heads = kind, heads
        width = heads * head_dim
        self.embed = nn.Embedding(vocab, width)
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, vocab)

    def forward(self, idx):
        rows, length = idx.shape
        q, k, v = (t.view(rows, length, self.heads, -1).transpose(1, 2) for t in self.qkv(self.embed(idx)).chunk(3, -1))
        positions = torch.arange(length, device=idx.device)
        allowed = positions[None, :] <= positions[:, None]
        if self.kind == "window":
            allowed = allowed & (positions[:, None] - positions[None, :] < 8)
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):  # what bf16 SDPA picks on an H200 anyway
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        return self.out(y.transpose(1, 2).reshape(rows, length, -1))


def loss_fn(model, batch):
    return F.cross_entropy(model(batch["idx"]).float().flatten(0, 1), batch["tgt"].flatten())


def updates(program, model, batch):
    """The loss and each parameter's change in one SGD(lr=1) step of `program`: minus its gradient."""
    ranks = SimulatedRanks(program, model, SGD, fxshard.Mesh())
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    metrics = ranks.step([batch])[0]
    after = ranks.parameters()
    return metrics["loss"].item(), {name: after[name].float() - value.float() for name, value in before.items()}


@given(kind=st.sampled_from(["causal", "window"]), heads=st.integers(1, 3), head_dim=st.sampled_from([16, 64, 128]),
       length=st.sampled_from([16, 64, 100]), seed=st.integers(0, 2))
def test_a_causal_mask_on_cudnn_becomes_is_causal_and_the_step_computes_the_same(kind, heads, head_dim, length, seed):
    torch.manual_seed(seed)
    model = Attention(kind, heads, head_dim).cuda()
    batch = {"idx": torch.randint(0, 32, (2, length), device="cuda"),
             "tgt": torch.randint(0, 32, (2, length), device="cuda")}
    programs = {p.name: p for p in run_pipeline(fxshard.trace(model, loss_fn, batch, optimizer=SGD, config=BF16),
                                                None, BF16)}
    if kind == "window":
        assert "causal_attention" not in programs
        return
    calls = [n for n in programs["causal_attention"].graph.nodes if n.target in ATTENTION_MASKS]
    assert tuple(n.target for n in calls) == CUDNN
    assert all(call_argument(n, "attn_bias") is None and call_argument(n, "is_causal") for n in calls)
    loss, moved = updates(programs["traced"], model, batch)
    causal_loss, causal_moved = updates(programs["causal_attention"], model, batch)
    assert abs(causal_loss - loss) <= 1e-2 * abs(loss)
    for name, delta in moved.items():
        assert (causal_moved[name] - delta).abs().max().item() <= 3e-2 * delta.abs().max().item(), name
