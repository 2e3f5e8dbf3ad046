"""The narrow_grads pass: one device, bf16 compute: AdamW and the norm read bf16 gradients as they are."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

import fxshard
from fxshard.models import GPT, GPTConfig, MoEGPT, MoEGPTConfig
from fxshard.passes.narrow_grads import narrow_grads

MODELS = {"gpt": lambda: GPT(GPTConfig.preset("tiny")), "moe": lambda: MoEGPT(MoEGPTConfig.preset("tiny"))}


def _trace(model, optimizer, **config):
    batch = {"idx": torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0)),
             "tgt": torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))}
    return fxshard.trace(model, lambda m, b: m.loss(b), batch, optimizer=optimizer,
                         config=fxshard.Config(param_dtype=torch.bfloat16, **config)), batch


def _inputs(program, model, batch, seed):
    generator = torch.Generator().manual_seed(seed)
    params = dict(model.named_parameters())
    args = []
    for spec, node in zip(program.inputs, program.placeholders()):
        value = node.meta["val"]
        if spec.kind.name == "PARAM":
            args.append(params[spec.name].detach().clone())
        elif spec.kind.name == "BATCH":
            args.append(batch[spec.name] if spec.name in batch else next(iter(batch.values())))
        elif spec.kind.name == "LR":
            args.append(torch.tensor(1e-2))
        elif spec.kind.name == "STEP":
            args.append(torch.tensor(3.0))
        else:  # optimizer state: moments (the second one positive)
            args.append(torch.rand(value.shape, generator=generator, dtype=value.dtype) * 1e-3)
    return args


@settings(max_examples=6, deadline=None)
@given(name=st.sampled_from(sorted(MODELS)), seed=st.integers(0, 3))
def test_adamw_updates_are_bit_identical_and_the_norm_agrees(name, seed):
    torch.manual_seed(seed)
    model = MODELS[name]()
    program, batch = _trace(model, fxshard.optim.AdamW(lr=1e-2, weight_decay=0.1), reduce_dtype=torch.float32)
    narrowed = narrow_grads(program)
    assert narrowed.notes["narrow_grads"] == sum(1 for p in model.parameters() if p.requires_grad)
    args = _inputs(program, model, batch, seed)
    ours, want = narrowed.graph_module(*args), program.graph_module(*args)
    for spec, a, b in zip(program.outputs, ours, want):
        if spec.kind.name == "GRAD_NORM":
            torch.testing.assert_close(a, b, rtol=1e-6, atol=0)
        elif spec.kind.name in ("PARAM", "OPT_STATE"):
            assert torch.equal(a, b), spec.name


@pytest.mark.parametrize("optimizer, config", [
    (fxshard.optim.SGD(lr=0.1, momentum=0.9), {}),                    # SGD's arithmetic reads the fp32 copy
    (fxshard.optim.AdamW(lr=1e-3), {"clip_grad_norm": 1.0}),           # so does clipping's scaling
    (fxshard.optim.AdamW(lr=1e-3), {"microbatches": 2}),               # and the microbatch sum
])
def test_casts_other_readers_need_are_kept(optimizer, config):
    torch.manual_seed(0)
    program, _ = _trace(GPT(GPTConfig.preset("tiny")), optimizer, **config)
    assert narrow_grads(program).notes["narrow_grads"] == 0


def test_shard_runs_it_on_one_device_with_bf16_compute_only():
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny"))
    batch = {"idx": torch.zeros(2, 8, dtype=torch.long), "tgt": torch.zeros(2, 8, dtype=torch.long)}
    names = [p.name for p in fxshard.shard(model, lambda m, b: m.loss(b), batch,
                                           config=fxshard.Config(param_dtype=torch.bfloat16)).programs]
    assert names == ["traced", "narrow_grads"]
    assert [p.name for p in fxshard.shard(model, lambda m, b: m.loss(b), batch).programs] == ["traced"]
