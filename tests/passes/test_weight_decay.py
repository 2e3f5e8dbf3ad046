"""Weight decay by parameter name (`AdamW(no_decay=...)`, `SGD(no_decay=...)`): the parameters the
patterns name train as a torch.optim parameter group with weight_decay=0 does, on one device and
through the passes (fsdp's units, pipeline stages)."""

import pytest
import torch
from hypothesis import given, strategies as st

import fxshard
from fxshard.api import _compile
from fxshard.dump import summarize
from fxshard.models import GPT, GPTConfig
from fxshard.testing import relative, torch_optimizer
from test_pipeline_split import assert_trains_like_eager, model_loss, token_microbatches

NO_DECAY = ("*norm.weight", "tok_emb.weight")  # GPT's RMSNorm gains and its embedding
CASES = {  # the mesh, Config, microbatches per data-parallel rank (one without pp: the helper traces one), layers
    "dp2-zero3": (fxshard.Mesh(dp=2), dict(sharding="optim_grads_params"), 1, 2),
    "dp2-zero1": (fxshard.Mesh(dp=2), dict(sharding="optim"), 1, 2),
    "pp2xdp2-zero3": (fxshard.Mesh(pp=2, dp=2), dict(sharding="optim_grads_params", microbatches=2), 2, 2),
    # two chunks per stage: the stage's no_decay unit spans both chunks' blocks
    "pp2xdp2-interleaved-zero3": (fxshard.Mesh(pp=2, dp=2), dict(sharding="optim_grads_params", microbatches=2,
                                                                schedule="interleaved-1f1b", virtual_stages=2), 2, 4),
}


def gpt(n_layer=2):
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=40, d_model=16, n_layer=n_layer, n_head=2, d_ff=24))


def optimizer_of(kind):  # a decay large enough that decaying the wrong parameters shows
    if kind == "adamw":
        return fxshard.optim.AdamW(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.5, no_decay=NO_DECAY)
    return fxshard.optim.SGD(lr=0.05, momentum=0.9, weight_decay=0.5, no_decay=NO_DECAY)


def test_the_named_parameters_train_without_decay_and_the_others_with_it():
    """One device, 3 steps, against torch.optim.AdamW with the two groups; and so far from AdamW
    decaying everything that the comparison tells the two apart."""
    batches = token_microbatches(40, 3, rows=4)
    model = gpt()
    optimizer = optimizer_of("adamw")
    step = fxshard.shard(model, model_loss, batches[0], optimizer=optimizer)
    grouped, everything = gpt(), gpt()
    eager = [(grouped, torch_optimizer(optimizer, grouped.named_parameters())),
             (everything, torch_optimizer(fxshard.optim.AdamW(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.5),
                                          everything.parameters()))]
    for batch in batches:
        loss = step(batch)["loss"].item()
        wants = []
        for reference, torch_opt in eager:
            torch_opt.zero_grad()
            want = model_loss(reference, batch)
            want.backward()
            torch_opt.step()
            wants.append(want.item())
        assert abs(loss - wants[0]) <= 1e-5 * abs(wants[0]), (loss, wants)
    ours = step.parameters()
    for name, p in grouped.named_parameters():
        assert relative(ours[name], p) < 1e-5, name
    decayed_too = dict(everything.named_parameters())
    assert relative(ours["norm.weight"], decayed_too["norm.weight"]) > 1e-3  # the groups mattered
    assert "without weight decay (no_decay): tok_emb.weight, layers.0.attn_norm.weight," in summarize(step.program)


@given(case=st.sampled_from(sorted(CASES)), kind=st.sampled_from(["adamw", "sgd"]))
def test_no_decay_groups_train_like_torch_param_groups_through_the_passes(case, kind):
    """Two steps on the simulator against eager PyTorch with the two parameter groups; under ZeRO the
    named parameters sit in fsdp units of their own (`:no_decay`; the blocks' in one across them),
    each updated without decay."""
    mesh, settings, microbatches, layers = CASES[case]
    config = fxshard.Config(**settings)
    steps = [token_microbatches(40, 2 * microbatches, seed=seed) for seed in range(2)]
    stages = assert_trains_like_eager(gpt(layers), model_loss, optimizer_of(kind), mesh, config, steps,
                                      key=("no_decay", kind, layers))
    for program in stages:
        undecayed = {u.name for u in program.updates if not u.decay}
        assert undecayed and undecayed == {unit.name for unit in program.units if unit.name.endswith(":no_decay")}
        assert "layers:no_decay" in undecayed  # one unit for the norm gains of every block on this rank
        for unit in program.units:
            names = [m.name for m in unit.members]
            assert all((unit.name in undecayed) == any(n.endswith(p.lstrip("*")) for p in NO_DECAY) for n in names), \
                (unit.name, names)


def test_no_decay_patterns_are_checked():
    with pytest.raises(fxshard.FxShardError, match="tuple of parameter-name patterns"):
        fxshard.optim.AdamW(no_decay="*.bias")  # a string would be its characters
    batch = token_microbatches(40, 1)[0]
    # a recipe's pattern for biases on a model without them: said, not refused (a typo reads the same)
    with pytest.warns(UserWarning, match=r"pattern '\*\.bias' matches no trainable parameter .*tok_emb.*exempts nothing") \
            as warned:
        step = fxshard.shard(gpt(), model_loss, batch, optimizer=fxshard.optim.SGD(weight_decay=0.1, no_decay=("*.bias",)))
    assert warned[0].filename == __file__  # it names the user's call, not fxshard's code
    assert all(u.decay for u in step.program.updates)
    # no weight decay to exempt from: ZeRO's units stay as they are without no_decay
    programs = _compile(gpt(), model_loss, batch, fxshard.optim.SGD(lr=0.1, no_decay=NO_DECAY), fxshard.Mesh(dp=2),
                        fxshard.Config(sharding="optim_grads_params"))
    assert [u.name for u in programs[-1].units] == ["pre", "layers.0", "layers.1", "post"]
    # whole blocks exempt: a unit per block still, gathered with its block (one across them would hold
    # every block's weights gathered for the whole forward)
    programs = _compile(gpt(), model_loss, batch, fxshard.optim.AdamW(weight_decay=0.1, no_decay=("layers.*",)),
                        fxshard.Mesh(dp=2), fxshard.Config(sharding="optim_grads_params"))
    assert [u.name for u in programs[-1].units] == ["pre", "layers.0:no_decay", "layers.1:no_decay", "post"]
