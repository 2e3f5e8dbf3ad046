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
@given(name=st.sampled_from(sorted(MODELS)), seed=st.integers(0, 3), clip=st.sampled_from([None, 0.05]))
def test_adamw_updates_are_bit_identical_and_the_norm_agrees(name, seed, clip):
    """Three AdamW steps of the program and of the narrowed one from the same state (SPMD simulator,
    one rank): parameters and moments equal bit for bit, the grad-norm metric to 1e-6. Clipping's
    coefficient is AdamW's grad_scale, no reader of the fp32 copy: narrowed too."""
    torch.manual_seed(seed)
    model = MODELS[name]()
    optimizer = fxshard.optim.AdamW(lr=1e-2, weight_decay=0.1)
    program, batch = _trace(model, optimizer, reduce_dtype=torch.float32, clip_grad_norm=clip)
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
    (fxshard.optim.SGD(lr=0.1), {"clip_grad_norm": 1.0}),              # so does clipping's scaling for SGD
    (fxshard.optim.AdamW(lr=1e-3), {"microbatches": 2}),               # and the microbatch sum
])
def test_casts_other_readers_need_are_kept(optimizer, config):
    torch.manual_seed(0)
    program, _ = _trace(GPT(GPTConfig.preset("tiny")), optimizer, **config)
    assert narrow_grads(program) is program


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


@pytest.mark.parametrize("case", ["dp1 optim", "dp1 optim_grads_params", "dp2 ep2 optim"])
@settings(max_examples=2, deadline=None)
@given(seed=st.integers(0, 3))
def test_flat_gradients_of_units_on_one_rank_axes_are_narrowed_bit_identically(case, seed):
    """FSDP units with no collective (every unit at dp=1; the expert units at dp=2 x ep=2, one rank on
    `edp`, scaled by 1/2): their flat gradient is concatenated in bf16. Three AdamW steps of the
    program before and after the pass (SPMD simulator): parameters and moments equal bit for bit; units
    reduced over two ranks keep their fp32 reduction."""
    from fxshard.passes import run_pipeline

    dp, *rest = case.split()
    mesh = fxshard.Mesh(dp=int(dp[2:]), ep=int(rest[0][2:]) if len(rest) == 2 else 1)
    torch.manual_seed(seed)
    model = MoEGPT(MoEGPTConfig.preset("tiny", n_expert=4)) if mesh.ep > 1 else GPT(GPTConfig.preset("tiny"))
    optimizer = fxshard.optim.AdamW(lr=1e-2, weight_decay=0.1)
    config = fxshard.Config(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, sharding=rest[-1])
    program, batch = _trace(model, optimizer, reduce_dtype=torch.float32)
    *_, before, after = run_pipeline(program, mesh, config)
    assert (before.name, after.name) == ("fsdp", "narrow_grads")
    one_rank = [unit for unit in after.units if unit.world == 1 and unit.trainable]
    assert after.notes["narrow_grads"] == sum(len(unit.members) for unit in one_rank) > 0
    reductions = [n for n in after.graph.nodes if n.target is torch.ops._c10d_functional.reduce_scatter_tensor.default]
    assert all(n.args[0].meta["val"].dtype == torch.float32 for n in reductions)
    assert len(reductions) == (len(after.units) - len(one_rank) if mesh.dp > 1 else 0)
    batches = [{k: v.roll(rank, dims=0) for k, v in batch.items()} for rank in range(mesh.size)]
    runs = [SimulatedRanks(p, model, optimizer, mesh) for p in (before, after)]
    for _ in range(3):
        want, ours = (ranks.step(batches)[0] for ranks in runs)
        torch.testing.assert_close(ours["grad_norm"], want["grad_norm"], rtol=1e-6, atol=0)
    for want_state, our_state in zip(*(ranks.states for ranks in runs)):
        assert want_state.keys() == our_state.keys()
        for key, value in want_state.items():
            assert torch.equal(our_state[key], value), key


def test_an_fp16_flat_gradient_scaled_by_one_over_ep_keeps_its_fp32_copy():
    """Halving in fp16 rounds gradients below 2^-14 * ep (common in fp16); the pass leaves such a unit's
    widening cast in place, so at dp=2 x ep=2 (expert units scaled, the rest reduced) nothing is narrowed."""
    from fxshard.passes import run_pipeline

    torch.manual_seed(0)
    model = MoEGPT(MoEGPTConfig.preset("tiny", n_expert=4))
    optimizer = fxshard.optim.AdamW(lr=1e-2)
    # the dynamic loss scale's unscaling is AdamW's grad_scale: no reader of the fp32 copies
    config = fxshard.Config(param_dtype=torch.float16, reduce_dtype=torch.float32, sharding="optim")
    batch = {"idx": torch.randint(0, 64, (2, 8)), "tgt": torch.randint(0, 64, (2, 8))}
    program = fxshard.trace(model, lambda m, b: m.loss(b), batch, optimizer=optimizer, config=config)
    programs = run_pipeline(program, fxshard.Mesh(dp=2, ep=2), config)
    assert programs[-1].name == "fsdp"
    assert [p.name for p in run_pipeline(program, fxshard.Mesh(dp=1), config)][-1] == "narrow_grads"  # unscaled
