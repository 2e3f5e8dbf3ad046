"""Single-device parity: fxshard.shard trains exactly like eager PyTorch with torch.optim."""

import pytest
import torch
from hypothesis import given, strategies as st

import fxshard
from fxshard.models import GPT, GPTConfig, MoEGPT, MoEGPTConfig
from fxshard.testing import eager_parity

ADAMW = fxshard.optim.AdamW(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
SGD_MOMENTUM = fxshard.optim.SGD(lr=0.05, momentum=0.9, weight_decay=0.01)


def token_batches(vocab, batch, seq, count, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [{"idx": torch.randint(0, vocab, (batch, seq), generator=generator),
             "tgt": torch.randint(0, vocab, (batch, seq), generator=generator)} for _ in range(count)]


def model_loss(model, batch):
    return model.loss(batch)


@pytest.mark.parametrize("optimizer", [ADAMW, SGD_MOMENTUM], ids=["adamw", "sgd_momentum"])
@pytest.mark.parametrize("make_model", [lambda: GPT(GPTConfig.preset("tiny")),
                                        lambda: MoEGPT(MoEGPTConfig.preset("tiny"))], ids=["gpt", "moe_gpt"])
def test_tiny_models_train_like_eager_for_20_steps(make_model, optimizer):
    torch.manual_seed(0)
    parity = eager_parity(make_model(), model_loss, token_batches(64, 4, 32, 20), optimizer)
    assert parity.max_loss_rel < 1e-5, parity.losses
    assert parity.max_param_rel < 1e-4
    first, last = parity.losses[0][1], parity.losses[-1][1]
    assert last != first  # the model actually trained


@given(batch=st.integers(1, 3), seq=st.sampled_from([4, 8, 12]), width=st.sampled_from([16, 32]),
       layers=st.integers(1, 3), experts=st.integers(1, 5), data=st.data())
def test_moe_gpt_parity_over_random_shapes(batch, seq, width, layers, experts, data):
    top_k = data.draw(st.integers(1, experts), label="top_k")
    shared = data.draw(st.sampled_from([None, 16]), label="d_ff_shared")
    cfg = MoEGPTConfig(vocab_size=32, d_model=width, n_layer=layers, n_head=2, n_expert=experts,
                       top_k=top_k, d_ff_expert=24, d_ff_shared=shared)
    torch.manual_seed(1)
    parity = eager_parity(MoEGPT(cfg), model_loss, token_batches(32, batch, seq, 4, seed=2), ADAMW)
    assert parity.max_loss_rel < 1e-5, parity.losses
    assert parity.max_param_rel < 1e-4


@given(batch=st.integers(1, 3), seq=st.sampled_from([4, 8]), width=st.sampled_from([8, 16, 24]),
       layers=st.integers(1, 3), heads=st.sampled_from([1, 2]))
def test_gpt_parity_over_random_shapes(batch, seq, width, layers, heads):
    cfg = GPTConfig(vocab_size=24, d_model=width, n_layer=layers, n_head=heads, d_ff=2 * width)
    torch.manual_seed(3)
    parity = eager_parity(GPT(cfg), model_loss, token_batches(24, batch, seq, 4, seed=4), SGD_MOMENTUM)
    assert parity.max_loss_rel < 1e-5, parity.losses
    assert parity.max_param_rel < 1e-4


def test_lr_schedule_callable_and_clipping_match_eager():
    schedule = fxshard.optim.AdamW(lr=lambda step: 1e-3 * min(1.0, step / 3), weight_decay=0.0)
    torch.manual_seed(0)
    parity = eager_parity(GPT(GPTConfig.preset("tiny")), model_loss, token_batches(64, 2, 16, 6), schedule,
                          config=fxshard.Config(clip_grad_norm=0.5))
    assert parity.max_loss_rel < 1e-5
    assert parity.max_param_rel < 1e-4


def test_set_lr_changes_the_update_without_retracing():
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny"))
    batch = token_batches(64, 2, 8, 1)[0]
    step = fxshard.shard(model, model_loss, batch, optimizer=fxshard.optim.SGD(lr=0.1))
    program = step.program
    step.set_lr(0.0)
    before = {k: v.clone() for k, v in step.parameters().items()}
    step(batch)
    assert all(torch.equal(before[k], v) for k, v in step.parameters().items())
    step.set_lr(0.1)
    step(batch)
    assert any(not torch.equal(before[k], v) for k, v in step.parameters().items())
    assert step.program is program
    for bad in (float("nan"), float("inf"), -1.0):
        with pytest.raises(fxshard.FxShardError, match="finite float >= 0"):
            step.set_lr(bad)


def test_gradient_accumulation_over_microbatches_matches_the_whole_batch():
    # SGD with momentum passes gradient differences on linearly: the tight check of the accumulation.
    torch.manual_seed(0)
    parity = eager_parity(MoEGPT(MoEGPTConfig.preset("tiny", aux_loss_coef=0.0)), model_loss,
                          token_batches(64, 6, 16, 5), SGD_MOMENTUM, config=fxshard.Config(microbatches=3))
    assert parity.max_loss_rel < 1e-5, parity.losses
    assert parity.max_param_rel < 1e-5
    # AdamW divides by sqrt(v) + eps: an expert weight whose gradient cancels to ~1e-9 (near eps = 1e-8)
    # moves by an amount set by the gradient's last bits, which the summation order over microbatches
    # changes (measured: one element of layers.1 fc2, gradient -8.2e-10, 5e-6 apart after the first step,
    # 1.2e-4 of the tensor's largest element on one CPU, under 1e-4 on another). Losses stay tight.
    torch.manual_seed(0)
    parity = eager_parity(MoEGPT(MoEGPTConfig.preset("tiny", aux_loss_coef=0.0)), model_loss,
                          token_batches(64, 6, 16, 5), ADAMW, config=fxshard.Config(microbatches=3))
    assert parity.max_loss_rel < 1e-5, parity.losses
    assert parity.max_param_rel < 1e-3
    with pytest.raises(fxshard.FxShardError, match="divisible by 4"):
        fxshard.trace(GPT(GPTConfig.preset("tiny")), model_loss, token_batches(64, 6, 8, 1)[0],
                      config=fxshard.Config(microbatches=4))


def test_a_float64_model_trains_like_eager_float64():
    """The gradient norm is taken in fp64 (vector_norm does not narrow), and AdamW's bias corrections
    are fp64 as torch's host floats are: in fp32, 1 - 0.999 ** 1 cancels to 6e-6 of the first updates."""
    from strategies import MLPStack, mse, regression_batch

    generator = torch.Generator().manual_seed(0)
    batches = [{k: v.double() for k, v in regression_batch(generator, 8).items()} for _ in range(4)]
    torch.manual_seed(0)
    parity = eager_parity(MLPStack([5, 3]).double(), mse, batches, fxshard.optim.AdamW(lr=1e-2))
    assert parity.max_loss_rel < 1e-7 and parity.max_param_rel < 1e-6, parity


class TransposedSoftplusGate(torch.nn.Module):
    """softplus, then a transposed flatten (Qwen3-Next's gated delta-net does this): the gradient
    reaching softplus_backward is transposed, and on CPU its output keeps that layout while the traced
    (fake) output is contiguous, so the view of it that the linear layer's backward traced cannot be
    a view of the real tensor."""

    def __init__(self):
        super().__init__()
        self.w, self.v = torch.nn.Linear(8, 4), torch.nn.Linear(4 * 6, 3)

    def forward(self, x):
        a = torch.nn.functional.softplus(self.w(x))
        return self.v(a.transpose(1, 2).reshape(x.shape[0], -1))


def test_a_kernel_whose_real_layout_differs_from_its_traced_one_still_replays_like_eager():
    torch.manual_seed(0)
    batches = [torch.randn(2, 6, 8) for _ in range(3)]
    parity = eager_parity(TransposedSoftplusGate(), lambda m, b: m(b).square().mean(), batches, ADAMW)
    assert parity.max_loss_rel < 1e-6 and parity.max_param_rel < 1e-5, parity
