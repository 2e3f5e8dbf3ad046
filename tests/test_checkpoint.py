"""Expert weight layouts (grouped / indexed keys, plain / GLU-interleaved fc1 rows) and state dicts
moving between them."""

import io
import itertools

import pytest
import torch
from hypothesis import given, strategies as st

import fxshard
from fxshard.checkpoint import ExpertLayout, convert_expert_tensors, deinterleave_glu, interleave_glu
from fxshard.models import GroupedLinear, MoEGPT, MoEGPTConfig
from fxshard.testing import eager_parity

LAYOUTS = [ExpertLayout(keys, size) for keys, size in itertools.product(("grouped", "indexed"), (None, 1, 2, 3))]


def random_layer(layout, experts, rows, cols, bias, seed):
    torch.manual_seed(seed)
    layer = GroupedLinear(experts, cols, rows, bias=bias, layout=layout, glu=True)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p))
    return layer


def roundtrip_file(state):
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


@given(source=st.sampled_from(LAYOUTS), target=st.sampled_from(LAYOUTS), experts=st.integers(1, 4),
       blocks=st.integers(1, 2), cols=st.integers(1, 3), bias=st.booleans())
def test_any_layout_loads_into_any_other_and_round_trips_bit_for_bit(source, target, experts, blocks, cols, bias):
    rows = 2 * 6 * blocks  # divisible by 2*size for size 1, 2, 3
    original = random_layer(source, experts, rows, cols, bias, seed=0)
    saved = roundtrip_file(original.state_dict())
    moved = random_layer(target, experts, rows, cols, bias, seed=1)
    moved.load_state_dict(saved)
    assert torch.equal(moved.weight_grouped(), original.weight_grouped())
    if bias:
        assert torch.equal(moved.bias_grouped(), original.bias_grouped())
    back = random_layer(source, experts, rows, cols, bias, seed=2)
    back.load_state_dict(roundtrip_file(moved.state_dict()))
    for key, value in original.state_dict().items():
        if not key.endswith("_extra_state"):
            assert torch.equal(back.state_dict()[key], value), key


def test_the_target_layout_already_present_is_passed_through_untouched():
    tensors = {"weight": torch.randn(3, 4, 2)}
    layout = ExpertLayout("grouped")
    converted = convert_expert_tensors(tensors, layout, layout, experts=3)
    assert converted["weight"] is tensors["weight"]


@pytest.mark.parametrize("drop", ["weight1", "bias2"])
def test_an_incomplete_indexed_set_is_an_error_not_a_partial_load(drop):
    source = random_layer(ExpertLayout("indexed"), 3, 4, 2, True, seed=0)
    state = source.state_dict()
    del state[drop]
    target = random_layer(ExpertLayout("grouped"), 3, 4, 2, True, seed=1)
    with pytest.raises(fxshard.FxShardError, match=f"incomplete indexed expert set.*{drop}"):
        target.load_state_dict(state)


def test_keys_decide_the_layout_when_a_state_dict_carries_no_layout_record():
    source = random_layer(ExpertLayout("indexed"), 2, 4, 3, False, seed=0)
    state = {k: v for k, v in source.state_dict().items() if not k.endswith("_extra_state")}
    target = random_layer(ExpertLayout("grouped"), 2, 4, 3, False, seed=1)
    target.load_state_dict(state, strict=False)
    assert torch.equal(target.weight, source.weight_grouped())


def test_a_models_own_parameters_without_a_layout_record_load_unchanged():
    """A dict of named_parameters() (or step.parameters()) has no _extra_state: a GLU-interleaved layer
    takes its rows as it stores them (they were read as plain rows and scrambled: logits off by 0.06)."""
    cfg = MoEGPTConfig.preset("tiny", d_ff_shared=None, glu_interleave_size=8)
    torch.manual_seed(0)
    source, target = MoEGPT(cfg), MoEGPT(cfg)
    target.load_state_dict({n: p.detach().clone() for n, p in source.named_parameters()}, strict=False)
    assert all(torch.equal(p, dict(source.named_parameters())[n]) for n, p in target.named_parameters())


def test_interleave_is_blocks_of_gate_then_linear_rows():
    plain = torch.arange(8.0).reshape(8, 1)  # gate rows 0..3, linear rows 4..7
    assert interleave_glu(plain, 2, dim=0).flatten().tolist() == [0, 1, 4, 5, 2, 3, 6, 7]
    assert torch.equal(deinterleave_glu(interleave_glu(plain, 2, dim=0), 2, dim=0), plain)
    with pytest.raises(fxshard.FxShardError, match="interleave"):
        interleave_glu(plain, 3, dim=0)


def test_moe_gpt_checkpoints_move_between_layouts_and_train_the_same():
    tiny = MoEGPTConfig.preset("tiny")
    torch.manual_seed(0)
    grouped = MoEGPT(tiny)
    indexed = MoEGPT(MoEGPTConfig.preset("tiny", expert_weights="indexed", glu_interleave_size=8))
    indexed.load_state_dict(roundtrip_file(grouped.state_dict()))
    idx = torch.randint(0, 64, (2, 16))
    assert torch.equal(indexed(idx), grouped(idx))
    assert "layers.0.moe.experts.fc1.weight3" in dict(indexed.named_parameters())
    generator = torch.Generator().manual_seed(0)
    batches = [{"idx": torch.randint(0, 64, (4, 16), generator=generator),
                "tgt": torch.randint(0, 64, (4, 16), generator=generator)} for _ in range(5)]
    optimizer = fxshard.optim.AdamW(lr=1e-3, weight_decay=0.1)
    parity = eager_parity(indexed, lambda m, b: m.loss(b), batches, optimizer,
                          config=fxshard.Config(fuse_grouped_mlp=True))
    assert parity.max_loss_rel < 1e-5 and parity.max_param_rel < 1e-4
    program = fxshard.trace(indexed, lambda m, b: m.loss(b), batches[0])
    from fxshard.passes import fuse_grouped_mlp

    assert len(fuse_grouped_mlp(program).notes["fused_grouped_mlp"]) == tiny.n_layer  # stacked weights fuse too


def test_experts_of_another_size_saved_in_another_layout_are_refused_before_anything_changes(tmp_path):
    """A layout conversion must check shapes too: grouped experts of width 64 do not load into an indexed
    model of width 32 (they used to, silently cut to their first rows) nor of width 128."""
    generator = torch.Generator().manual_seed(0)
    batch = {"idx": torch.randint(0, 64, (2, 16), generator=generator),
             "tgt": torch.randint(0, 64, (2, 16), generator=generator)}

    def shard(**overrides):
        torch.manual_seed(0)
        return fxshard.shard(MoEGPT(MoEGPTConfig.preset("tiny", **overrides)), lambda m, b: m.loss(b), batch,
                             fxshard.optim.AdamW())
    step = shard()
    step(batch)
    fxshard.save(step, tmp_path / "grouped")
    for width in (32, 128):
        other = shard(expert_weights="indexed", d_ff_expert=width)
        before = {key: value.clone() for key, value in other.state.items()}
        with pytest.raises(fxshard.FxShardError, match=r"experts of 'layers\.0\.moe\.experts\.fc1\.'.* do not fit"):
            fxshard.load(other, tmp_path / "grouped")
        assert other.step_count == 0 and all(torch.equal(other.state[k], v) for k, v in before.items())
    fxshard.load(shard(expert_weights="indexed"), tmp_path / "grouped")  # the same size converts
