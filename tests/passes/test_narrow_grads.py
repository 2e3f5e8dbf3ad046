"""The narrow_grads pass: one device, bf16 compute: AdamW and the norm read bf16 gradients as they are."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

import fxshard
from fxshard.models import GPT, GPTConfig, MoEGPT, MoEGPTConfig
from fxshard.passes.narrow_grads import narrow_grads
from fxshard.testing import SimulatedRanks

MODELS = {"gpt": lambda: GPT(GPTConfig.preset("tiny")), "moe": lambda: MoEGPT(MoEGPTConfig.preset("tiny"))}


def _trace(model, optimizer, **config):
    batch = {"idx": torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0)),
             "tgt": torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))}
    return fxshard.trace(model, lambda m, b: m.loss(b), batch, optimizer=optimizer,
                         config=fxshard.Config(param_dtype=torch.bfloat16, **config)), batch


@settings(max_examples=6, deadline=None)
@given(name=st.sampled_from(sorted(MODELS)), seed=st.integers(0, 3))
def test_adamw_updates_are_bit_identical_and_the_norm_agrees(name, seed):
    """Three AdamW steps of the program and of the narrowed one from the same state (SPMD simulator,
    one rank): parameters and moments equal bit for bit, the grad-norm metric to 1e-6."""
    torch.manual_seed(seed)
    model = MODELS[name]()
    optimizer = fxshard.optim.AdamW(lr=1e-2, weight_decay=0.1)
    program, batch = _trace(model, optimizer, reduce_dtype=torch.float32)
    narrowed = narrow_grads(program)
    assert narrowed.notes["narrow_grads"] == sum(1 for p in model.parameters() if p.requires_grad)
    runs = [SimulatedRanks(p, model, optimizer, fxshard.Mesh()) for p in (program, narrowed)]
    for _ in range(3):
        want, ours = (ranks.step([batch])[0] for ranks in runs)
        torch.testing.assert_close(ours["grad_norm"], want["grad_norm"], rtol=1e-6, atol=0)
    (want_state,), (our_state,) = (ranks.states for ranks in runs)
    assert want_state.keys() == our_state.keys()
    for key, value in want_state.items():
        assert torch.equal(our_state[key], value), key


@pytest.mark.parametrize("optimizer, config", [
    (fxshard.optim.SGD(lr=0.1, momentum=0.9), {}),                    # SGD's arithmetic reads the fp32 copy
    (fxshard.optim.AdamW(lr=1e-3), {"clip_grad_norm": 1.0}),           # so does clipping's scaling
    (fxshard.optim.AdamW(lr=1e-3), {"microbatches": 2}),               # and the microbatch sum
])
def test_casts_other_readers_need_are_kept(optimizer, config):
    torch.manual_seed(0)
    program, _ = _trace(GPT(GPTConfig.preset("tiny")), optimizer, **config)
    assert narrow_grads(program).notes["narrow_grads"] == 0


def test_shard_runs_it_on_one_device_with_bf16_compute_only_and_the_dump_shows_it(tmp_path):
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny"))
    batch = {"idx": torch.zeros(2, 8, dtype=torch.long), "tgt": torch.zeros(2, 8, dtype=torch.long)}
    step = fxshard.shard(model, lambda m, b: m.loss(b), batch,
                         config=fxshard.Config(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                               dump_dir=str(tmp_path)))
    assert [p.name for p in step.programs] == ["traced", "narrow_grads"]
    removed = step.program.notes["narrow_grads"]
    assert removed == sum(1 for _ in model.parameters())
    summary = (tmp_path / "01_narrow_grads.summary.txt").read_text()
    assert f"narrow_grads: {removed}" in summary
    def casts(name):
        return sum(" = _to_copy(" in line for line in (tmp_path / f"{name}.nodes.txt").read_text().splitlines())

    assert casts("01_narrow_grads") == casts("00_traced") - removed
    assert [p.name for p in fxshard.shard(model, lambda m, b: m.loss(b), batch).programs] == ["traced"]
