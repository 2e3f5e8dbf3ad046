"""Attention with sinks on the fused kernels (fxshard/sink_attention.py) against transformers'
GPT-OSS eager attention: the function, its gradients, and a GPT-OSS training step."""

import copy

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, strategies as st

import fxshard
from fxshard.sink_attention import sink_attention
from fxshard.testing import relative, torch_optimizer


def eager_sink_attention(q, k, v, mask, sinks, scale):
    """transformers' GPT-OSS eager_attention_forward, as written there (k, v already repeated)."""
    weights = q @ k.transpose(2, 3) * scale
    if mask is not None:
        weights = weights + mask
    column = sinks.reshape(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[-2], -1)
    logits = torch.cat([weights, column], dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    return F.softmax(logits, dim=-1)[..., :-1] @ v


@given(batch=st.integers(1, 2), heads=st.integers(1, 3), rows=st.integers(1, 20), dim=st.sampled_from([4, 8]),
       window=st.one_of(st.none(), st.integers(1, 6)), masked=st.booleans(), seed=st.integers(0, 2**16))
def test_sink_attention_computes_the_eager_function_and_its_gradients(batch, heads, rows, dim, window, masked, seed):
    mask = causal_mask(batch, rows, window, "cpu") if masked else None
    assert_like_eager(batch, heads, rows, dim, mask, 3.0, 0.35, torch.Generator().manual_seed(seed), 1e-5)


def causal_mask(batch, rows, window, device):
    """Causal, or a sliding window of `window` keys (GPT-OSS alternates them), additive as transformers
    makes it: [batch, 1, rows, rows]."""
    i = torch.arange(rows, device=device)
    seen = (i[None, :] <= i[:, None]) & ((i[:, None] - i[None, :] < window) if window else True)
    return torch.zeros(batch, 1, rows, rows, device=device).masked_fill(~seen, torch.finfo(torch.float32).min)


def assert_like_eager(batch, heads, rows, dim, mask, sink_scale, scale, generator, tolerance):
    """sink_attention's output and its four gradients against eager_sink_attention's, on random
    inputs drawn from `generator` (on its device)."""
    device = generator.device
    q, k, v = (torch.randn(batch, heads, rows, dim, device=device, generator=generator, requires_grad=True)
               for _ in range(3))
    sinks = (sink_scale * torch.randn(heads, device=device, generator=generator)).requires_grad_()
    grad = torch.randn(batch, heads, rows, dim, device=device, generator=generator)
    expected = eager_sink_attention(q, k, v, mask, sinks, scale)
    got = sink_attention(q, k, v, mask, sinks, scale)
    assert relative(got, expected) < tolerance
    for ours, theirs in zip(torch.autograd.grad(got, (q, k, v, sinks), grad),
                            torch.autograd.grad(expected, (q, k, v, sinks), grad)):
        assert relative(ours, theirs) < tolerance


def gpt_oss():
    transformers = pytest.importorskip("transformers")
    config = transformers.GptOssConfig(vocab_size=64, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
                                       num_experts_per_tok=2, sliding_window=4, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0, 2)  # learned: far from their zero start
    assert model.config.layer_types == ["sliding_attention", "full_attention"]
    return model


def hf_loss(model, batch):
    return F.cross_entropy(model(batch["idx"]).logits.flatten(0, 1), batch["tgt"].flatten())


def assert_trains_like(reference, step, optimizer, batches, tolerance):
    """`step` and the eager `reference` model under torch's version of `optimizer`: each batch's loss
    and, at the end, every parameter within `tolerance`, relative."""
    eager_optimizer = torch_optimizer(optimizer, reference.named_parameters())
    for batch in batches:
        loss = hf_loss(reference, batch)
        loss.backward()
        eager_optimizer.step()
        eager_optimizer.zero_grad()
        assert abs(step(batch)["loss"].item() - loss.item()) < tolerance * loss.item()
    trained = step.parameters()
    for name, param in reference.named_parameters():
        assert relative(trained[name], param) < tolerance, name


def test_gpt_oss_trains_like_its_eager_attention_with_sinks_on_the_fused_kernel():
    """Both of GPT-OSS's attention kinds (a sliding window, full) traced as `sink_attention`, three
    SGD steps against the model's own eager code. (SGD: under AdamW at lr 1e-2 the experts' weights
    end 1.7e-4 relative apart after 3 steps with or without this swap, as measured: AdamW amplifies
    rounding-level gradient differences there; SGD's agree to 1e-6.)"""
    model = gpt_oss()
    generator = torch.Generator().manual_seed(1)
    batches = [{"idx": torch.randint(0, 64, (2, 12), generator=generator),
                "tgt": torch.randint(0, 64, (2, 12), generator=generator)} for _ in range(3)]
    optimizer = fxshard.optim.SGD(lr=0.1, momentum=0.9)
    reference = copy.deepcopy(model)
    step = fxshard.shard(model, hf_loss, batches[0], optimizer)
    assert [line.split(":")[0] for line in step.program.notes["attention_forwards"]] == \
        ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    nodes = list(step.program.graph.nodes)
    assert sum(node.target is torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
               for node in nodes) == 2
    assert not [node for node in nodes if node.target is torch.ops.aten._softmax.default
                and node.args[0].meta["val"].shape[-1] == 12 + 1]  # the eager softmax over scores and sink
    assert_trains_like(reference, step, optimizer, batches, 1e-5)


def test_gpt_oss_asked_for_its_attention_weights_or_with_dropout_keeps_the_eager_attention():
    """Weights asked for by the config or by the call, or attention dropout in training: the eager
    attention, and the notes list no layer as swapped."""
    batch = {"idx": torch.zeros(1, 8, dtype=torch.long), "tgt": torch.zeros(1, 8, dtype=torch.long)}

    def attention_entropy_loss(model, batch):  # a loss on the weights themselves
        out = model(batch["idx"], output_attentions=True)
        weights = torch.stack(out.attentions)
        return F.cross_entropy(out.logits.flatten(0, 1), batch["tgt"].flatten()) + (weights * weights).sum()

    model = gpt_oss()
    model.config.output_attentions = True
    assert "attention_forwards" not in fxshard.trace(model, hf_loss, batch).notes
    program = fxshard.trace(gpt_oss(), attention_entropy_loss, batch)
    assert "attention_forwards" not in program.notes
    model = gpt_oss()
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.1
    assert "attention_forwards" not in fxshard.trace(model, hf_loss, batch).notes


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rows, window", [(64, None), (40, 8), (128, 16)])
def test_sink_attention_on_cuda_memory_efficient_kernel_matches_the_eager_function(rows, window):
    """On CUDA the memory-efficient kernel (its backward given the log-sum-exp with the sink), fp32,
    a causal or sliding-window mask, rows that do and do not align the mask to 16 columns."""
    assert_like_eager(2, 4, rows, 64, causal_mask(2, rows, window, "cuda"), 2.0, 0.125,
                      torch.Generator(device="cuda").manual_seed(rows), 1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpt_oss_on_cuda_trains_like_its_eager_attention():
    """On CUDA: the memory-efficient kernel with the sliding-window mask as its bias, and with the
    full layers' causal mask turned into is_causal by the causal_attention pass, fp32, three SGD
    steps against the model's own eager code (with codegen; fp32 experts run on the grouped-GEMM
    reference backend, which CUDA graphs cannot capture)."""
    model = gpt_oss().cuda()
    generator = torch.Generator().manual_seed(1)
    batches = [{"idx": torch.randint(0, 64, (2, 48), generator=generator).cuda(),
                "tgt": torch.randint(0, 64, (2, 48), generator=generator).cuda()} for _ in range(3)]
    optimizer = fxshard.optim.SGD(lr=0.1, momentum=0.9)
    reference = copy.deepcopy(model)
    step = fxshard.shard(model, hf_loss, batches[0], optimizer, config=fxshard.Config(cuda_graphs=False))
    assert "causal_attention" in step.program.notes  # the full layers' masks
    assert sum(node.target is torch.ops.aten._scaled_dot_product_efficient_attention_backward.default
               for node in step.program.graph.nodes) == 2
    assert_trains_like(reference, step, optimizer, batches, 1e-4)
