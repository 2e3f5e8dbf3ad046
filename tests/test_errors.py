"""Errors users can cause raise FxShardError with the cause, the user's line and the fix."""

import pytest
import torch
import torch.nn as nn

import fxshard
from fxshard import FxShardError
from fxshard.models import GPT, GPTConfig


class ReadsItem(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        scale = x.abs().max().item()  # host read of a tensor value
        return self.lin(x) * scale


class BranchesOnData(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        if x.sum() > 0:  # data-dependent control flow
            return self.lin(x)
        return -self.lin(x)


def mean_loss(model, batch):
    return model(batch).mean()


@pytest.mark.parametrize("model, cause, line", [
    (ReadsItem(), "reads a tensor's value on the host", "scale = x.abs().max().item()"),
    (BranchesOnData(), "tensor", "if x.sum() > 0:"),
])
def test_untraceable_models_name_the_cause_and_the_source_line(model, cause, line):
    with pytest.raises(FxShardError) as info:
        fxshard.shard(model, mean_loss, torch.randn(2, 4))
    message = str(info.value)
    assert cause in message
    assert line in message and "test_errors.py" in message


def test_boolean_indexing_is_a_dynamic_shape_error():
    class Masked(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return self.lin(x[x > 0].view(-1, 4))

    with pytest.raises(FxShardError, match="static"):
        fxshard.shard(Masked(), mean_loss, torch.randn(2, 4))


@pytest.fixture(scope="module")
def tiny_step():
    model = GPT(GPTConfig.preset("tiny"))
    batch = {"idx": torch.zeros(2, 8, dtype=torch.long), "tgt": torch.zeros(2, 8, dtype=torch.long)}
    return fxshard.shard(model, lambda m, b: m.loss(b), batch), batch


def test_batch_with_other_shape_is_rejected_with_the_traced_shape(tiny_step):
    step, batch = tiny_step
    with pytest.raises(FxShardError, match=r"batch\['idx'\] has shape \(2, 9\).*traced for shape \(2, 8\)"):
        step({"idx": torch.zeros(2, 9, dtype=torch.long), "tgt": batch["tgt"]})


def test_batch_with_other_dtype_or_structure_is_rejected(tiny_step):
    step, batch = tiny_step
    with pytest.raises(FxShardError, match="dtype"):
        step({"idx": batch["idx"].int(), "tgt": batch["tgt"]})
    with pytest.raises(FxShardError, match="structure"):
        step({"idx": batch["idx"]})
    with pytest.raises(FxShardError, match="structure"):
        step((batch["idx"], batch["tgt"]))


def test_non_scalar_loss_is_rejected():
    with pytest.raises(FxShardError, match="scalar"):
        fxshard.shard(nn.Linear(4, 4), lambda m, b: m(b), torch.randn(2, 4))


def test_model_without_trainable_parameters_is_rejected():
    frozen = nn.Linear(4, 4).requires_grad_(False)
    with pytest.raises(FxShardError, match="no trainable parameters"):
        fxshard.shard(frozen, mean_loss, torch.randn(2, 4))


def test_non_tensor_batch_leaf_and_bad_arguments_are_rejected():
    with pytest.raises(FxShardError, match="not a tensor"):
        fxshard.shard(nn.Linear(4, 4), lambda m, b: m(b["x"]).mean(), {"x": torch.randn(2, 4), "n": 3})
    with pytest.raises(FxShardError, match="fxshard.optim"):
        model = nn.Linear(4, 4)
        fxshard.shard(model, mean_loss, torch.randn(2, 4), optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(FxShardError, match="lr"):
        fxshard.optim.AdamW(lr=-1.0)


def test_half_meta_model_is_rejected_and_a_meta_model_traces():
    with torch.device("meta"):
        model = nn.Linear(4, 4)
    half = nn.Sequential(model, nn.Linear(4, 4))
    with pytest.raises(FxShardError, match="mixes meta-device and real"):
        fxshard.shard(half, mean_loss, torch.randn(2, 4))
    program = fxshard.trace(model, mean_loss, torch.randn(2, 4))
    assert program.inputs_of(fxshard.InputKind.PARAM)[0].shape == (4, 4)


def test_check_rejects_without_processes_what_shard_would_reject_on_every_rank():
    from fxshard.models import GPT, GPTConfig

    batch = {"idx": torch.randint(0, 64, (2, 8)), "tgt": torch.randint(0, 64, (2, 8))}
    model = GPT(GPTConfig.preset("tiny"))
    with pytest.raises(fxshard.FxShardError, match="Mesh\\(ep=2\\) but the program has no expert ops"):
        fxshard.check(model, lambda m, b: m.loss(b), batch, mesh=fxshard.Mesh(dp=2, ep=2))
    with pytest.raises(fxshard.FxShardError, match="mesh must be fxshard.Mesh"):
        fxshard.check(model, lambda m, b: m.loss(b), batch, mesh="dp=2")
    fxshard.check(model, lambda m, b: m.loss(b), batch, mesh=fxshard.Mesh(dp=2))  # fine: returns quietly
