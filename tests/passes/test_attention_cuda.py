"""The attention passes on CUDA in bf16: causal_attention drops a causal mask from cuDNN's kernel
(what bf16 SDPA traces as on Hopper; SDPA writes a boolean mask as 0 / -65536 for it), and
flash_attention moves attention left on the memory-efficient kernel without a mask or with a
sliding-window mask, and cuDNN's with a sliding-window mask, to flash, forward and backward. The step computes what it computed before, up
to the kernels' rounding in bf16."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from hypothesis import given, strategies as st

import fxshard
from fxshard.graph import call_argument
from fxshard.passes import run_pipeline
from fxshard.passes.causal_attention import ATTENTION_MASKS
from fxshard.passes.flash_attention import EFFICIENT, EFFICIENT_BACKWARD, FLASH, FLASH_BACKWARD
from fxshard.testing import SimulatedRanks

EFFICIENT_PAIR = ["_scaled_dot_product_efficient_attention", "_scaled_dot_product_efficient_attention_backward"]
FLASH_PAIR = ["_flash_attention_backward", "_flash_attention_forward"]
CUDNN = (torch.ops.aten._scaled_dot_product_cudnn_attention.default,
         torch.ops.aten._scaled_dot_product_cudnn_attention_backward.default)

pytestmark = pytest.mark.gpu
BF16 = fxshard.Config(param_dtype=torch.bfloat16)
SGD = fxshard.optim.SGD(lr=1.0)  # a step moves each parameter by its gradient: the updates are compared


class Attention(nn.Module):
    """One attention layer on `backend` (by default the memory-efficient kernel): a causal mask it
    builds itself (which causal_attention turns into is_causal), no mask (full attention), or a
    sliding window of 8 keys (flash's window)."""

    def __init__(self, kind, heads, head_dim, vocab=32, backend=SDPBackend.EFFICIENT_ATTENTION):
        super().__init__()
        self.kind, self.heads, self.backend = kind, heads, backend
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
        mask = None if self.kind == "none" else allowed
        with sdpa_kernel([self.backend]):  # bf16 SDPA would pick cuDNN's on Hopper
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out(y.transpose(1, 2).reshape(rows, length, -1))


def loss_fn(model, batch):
    return F.cross_entropy(model(batch["idx"]).float().flatten(0, 1), batch["tgt"].flatten())


def kernels(program):
    return sorted(str(n.target).split(".")[1] for n in program.graph.nodes
                  if n.target in (EFFICIENT, EFFICIENT_BACKWARD, FLASH, FLASH_BACKWARD))


def updates(program, model, batch):
    """Each parameter's change in one SGD(lr=1) step of `program` on one device: minus its gradient."""
    ranks = SimulatedRanks(program, model, SGD, fxshard.Mesh())
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    metrics = ranks.step([batch])[0]
    after = ranks.parameters()
    return metrics["loss"].item(), {name: after[name].float() - value.float() for name, value in before.items()}


def assert_same_step(before, after, model, batch, tolerance=3e-2):
    loss_before, moved_before = updates(before, model, batch)
    loss_after, moved_after = updates(after, model, batch)
    assert abs(loss_after - loss_before) <= 1e-2 * abs(loss_before)
    for name, delta in moved_before.items():
        scale = delta.abs().max().item()
        assert (moved_after[name] - delta).abs().max().item() <= tolerance * scale, name


def programs_of(model, batch, config=BF16):
    programs = run_pipeline(fxshard.trace(model, loss_fn if isinstance(model, Attention) else hf_loss, batch,
                                          optimizer=SGD, config=config), None, config)
    return {p.name: p for p in programs}


@given(kind=st.sampled_from(["causal", "none", "window"]), heads=st.integers(1, 3),
       head_dim=st.sampled_from([8, 64, 128]), length=st.sampled_from([32, 64, 48]), seed=st.integers(0, 2))
def test_attention_without_a_mask_or_with_a_window_moves_to_flash_and_the_step_computes_the_same(kind, heads, head_dim,
                                                                                                length, seed):
    torch.manual_seed(seed)
    model = Attention(kind, heads, head_dim).cuda()
    batch = {"idx": torch.randint(0, 32, (2, length), device="cuda"),
             "tgt": torch.randint(0, 32, (2, length), device="cuda")}
    programs = programs_of(model, batch)
    final = list(programs.values())[-1]
    if length % 32:  # the memory-efficient kernel pads its log-sum-exp: unchanged
        assert "flash_attention" not in programs and kernels(final) == EFFICIENT_PAIR
        return
    assert kernels(final) == FLASH_PAIR
    note = final.notes["flash_attention"]
    assert f"1 attention calls ({int(kind == 'window')} with a sliding window) and 1 backward calls" in note, note
    assert_same_step(programs.get("causal_attention", programs["traced"]), final, model, batch)


def test_fp32_attention_stays_on_the_memory_efficient_kernel():
    """Flash has no fp32 kernel: an fp32 step keeps the one it was traced with."""
    model = Attention("causal", 2, 8).cuda()
    batch = {"idx": torch.randint(0, 32, (2, 32), device="cuda"), "tgt": torch.randint(0, 32, (2, 32), device="cuda")}
    programs = programs_of(model, batch, fxshard.Config())
    assert "flash_attention" not in programs and "causal_attention" in programs


def hf_loss(model, batch):
    return F.cross_entropy(model(batch["idx"]).logits.float().flatten(0, 1), batch["tgt"].flatten())


def test_gpt_oss_sink_attention_runs_on_flash_with_its_sliding_window():
    """GPT-OSS's attention with sinks (fxshard/sink_attention.py) on the memory-efficient kernel: its
    full-attention layer and its sliding-window layer (the window as flash's window_size_left) move to
    flash, the sinks' log-sum-exp given to flash's backward."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GptOssConfig(vocab_size=64, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                                       num_experts_per_tok=2, sliding_window=8, max_position_embeddings=128)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(config).cuda()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0, 2)
    batch = {"idx": torch.randint(0, 64, (2, 64), device="cuda"), "tgt": torch.randint(0, 64, (2, 64), device="cuda")}
    programs = programs_of(model, batch)
    final = list(programs.values())[-1]
    assert kernels(final) == sorted(FLASH_PAIR * 2)
    assert "2 attention calls (1 with a sliding window) and 2 backward calls" in final.notes["flash_attention"]
    assert_same_step(programs["causal_attention"], final, model, batch)


@given(kind=st.sampled_from(["causal", "window"]), heads=st.integers(1, 3), head_dim=st.sampled_from([16, 64, 128]),
       length=st.sampled_from([16, 64, 100]), seed=st.integers(0, 2))
def test_a_causal_mask_on_cudnn_becomes_is_causal_a_window_moves_to_flash_and_the_step_computes_the_same(
        kind, heads, head_dim, length, seed):
    torch.manual_seed(seed)
    model = Attention(kind, heads, head_dim, backend=SDPBackend.CUDNN_ATTENTION).cuda()
    batch = {"idx": torch.randint(0, 32, (2, length), device="cuda"),
             "tgt": torch.randint(0, 32, (2, length), device="cuda")}
    programs = programs_of(model, batch)
    if kind == "window":  # not the causal pattern: flash's window (cuDNN's op has none), any length
        # recompute_pointwise follows where codegen compiles (CUDA by default); no other attention pass runs
        assert [name for name in programs if name != "recompute_pointwise"] == ["traced", "flash_attention"]
        assert kernels(programs["flash_attention"]) == FLASH_PAIR
        assert "1 attention calls (1 with a sliding window) and 1 backward calls" in \
            programs["flash_attention"].notes["flash_attention"]
        assert_same_step(programs["traced"], programs["flash_attention"], model, batch)
        return
    calls = [n for n in programs["causal_attention"].graph.nodes if n.target in ATTENTION_MASKS]
    assert tuple(n.target for n in calls) == CUDNN
    assert all(call_argument(n, "attn_bias") is None and call_argument(n, "is_causal") for n in calls)
    assert_same_step(programs["traced"], programs["causal_attention"], model, batch)


def test_gemma3_sliding_window_layers_leave_cudnn_for_flash_and_its_full_layers_stay_causal_on_cudnn():
    """transformers' Gemma 3 in bf16 (SDPA on cuDNN's kernel, the masks as bias tensors, grouped key-value
    heads repeated): the full-attention layer's causal mask becomes cuDNN's is_causal, the sliding-window
    layer moves to flash's window, and the step computes what the traced one does."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Gemma3TextConfig(vocab_size=64, hidden_size=128, intermediate_size=64, num_hidden_layers=2,
                                           num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                           sliding_window=16, layer_types=["sliding_attention", "full_attention"],
                                           max_position_embeddings=128, attention_dropout=0.0)
    torch.manual_seed(0)
    model = transformers.Gemma3ForCausalLM(config).cuda()
    batch = {"idx": torch.randint(0, 64, (2, 64), device="cuda"), "tgt": torch.randint(0, 64, (2, 64), device="cuda")}
    programs = programs_of(model, batch)
    final = list(programs.values())[-1]
    cudnn = [n for n in final.graph.nodes if n.target in CUDNN]
    assert len(cudnn) == 2 and all(call_argument(n, "is_causal") and call_argument(n, "attn_bias") is None
                                   for n in cudnn)
    assert kernels(final) == FLASH_PAIR
    assert [n.kwargs["window_size_left"] for n in final.graph.nodes if n.target is FLASH] == [15]
    assert_same_step(programs["traced"], final, model, batch)
