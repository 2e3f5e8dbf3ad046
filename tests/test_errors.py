"""Errors users can cause raise FxShardError with the cause, the user's line and the fix."""

import re

import pytest
import torch
import torch.nn as nn

import fxshard
from fxshard import FxShardError
from fxshard.launch import run_local
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


def reads_memory(model, batch):
    return model(batch).mean() * (batch.data_ptr() != 0)  # what a hand-launched kernel does


def calls_backward(model, batch):
    loss = model(batch).mean()
    loss.backward()
    return loss


def converts_to_numpy(model, batch):
    return model(torch.from_numpy(batch.numpy())).mean()


@pytest.mark.parametrize("loss_fn, cause, fix", [
    (reads_memory, "reads a tensor's memory directly", "torch.library.custom_op"),
    (calls_backward, "loss_fn calls .backward()", "return the loss instead"),
    (converts_to_numpy, "converts a tensor to NumPy", "keep the computation in torch ops"),
])
def test_host_side_tensor_uses_are_explained_without_torch_internals(loss_fn, cause, fix):
    with pytest.raises(FxShardError) as info:
        fxshard.trace(nn.Linear(4, 4), loss_fn, torch.randn(2, 4))
    message = str(info.value)
    assert cause in message and fix in message and "test_errors.py" in message, message
    assert "FunctionalTensor" not in message and "FakeTensor" not in message and "mirrored meta" not in message


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


def test_token_ids_out_of_range_are_named_and_leave_the_step_usable():
    """A bad batch whose error comes from the forward (an index past the vocabulary) fails before anything
    of the state is written: the step says so, stays usable, and trains on as if it had not been called.
    An error after the first in-place update still marks the state partly updated (test_nonfinite.py)."""
    good = {"idx": torch.randint(0, 64, (2, 8)), "tgt": torch.randint(0, 64, (2, 8))}

    def tiny():
        torch.manual_seed(0)
        return fxshard.shard(GPT(GPTConfig.preset("tiny")), lambda m, b: m.loss(b), good)
    steps = [tiny(), tiny()]
    steps[0](good)
    for bad, op in (({**good, "idx": good["idx"] + 64}, "embedding"), ({**good, "tgt": good["tgt"] + 64}, "nll_loss")):
        with pytest.raises(FxShardError, match=rf"step 2: .*\({op}.*\) raised IndexError.*training state .*unchanged"):
            steps[0](bad)
    with pytest.raises(FxShardError, match=r"the evaluation after step 1: .*\(embedding.*\) raised IndexError"):
        steps[0].evaluate({**good, "idx": good["idx"] + 64})  # evaluate says it too (it raised a bare IndexError)
    steps[1](good)
    assert steps[0](good)["loss"].item() == steps[1](good)["loss"].item()
    assert all(torch.equal(steps[0].parameters()[n], p) for n, p in steps[1].parameters().items())


def test_batch_with_other_dtype_or_structure_is_rejected(tiny_step):
    step, batch = tiny_step
    with pytest.raises(FxShardError, match=r"batch\['idx'\] has dtype torch.int32, but the step was traced for "
                                           r"torch.int64; convert it \(.to\(torch.int64\)\)"):
        step({"idx": batch["idx"].int(), "tgt": batch["tgt"]})
    with pytest.raises(FxShardError, match=r"missing batch\['tgt'\]; not in the example: batch\['target'\]"):
        step({"idx": batch["idx"], "target": batch["tgt"]})
    with pytest.raises(FxShardError, match=r"missing batch\['tgt'\]; not in the example: nothing"):
        step({"idx": batch["idx"]})
    with pytest.raises(FxShardError, match=r"not shaped like the example_batch.*pass the leaves batch\['idx'\], "):
        step((batch["idx"], batch["tgt"]))


def test_a_dict_batch_with_its_keys_in_another_order_is_the_same_batch(tiny_step):
    step, _ = tiny_step
    generator = torch.Generator().manual_seed(0)
    idx, tgt = (torch.randint(0, 64, (2, 8), generator=generator) for _ in range(2))
    ordered = step.evaluate({"idx": idx, "tgt": tgt})["loss"]
    assert torch.equal(step.evaluate({"tgt": tgt, "idx": idx})["loss"], ordered)
    assert not torch.equal(step.evaluate({"idx": tgt, "tgt": idx})["loss"], ordered)  # the leaves do differ


def test_non_scalar_or_integer_loss_is_rejected_with_the_fix_for_each():
    with pytest.raises(FxShardError, match=r"scalar tensor, got shape \(2, 4\); reduce it"):
        fxshard.shard(nn.Linear(4, 4), lambda m, b: m(b), torch.randn(2, 4))
    with pytest.raises(FxShardError, match="returned a torch.int64 tensor; a loss must be floating point"):
        fxshard.shard(nn.Linear(4, 4), lambda m, b: (m(b) > 0).sum(), torch.randn(2, 4))


def test_a_meta_example_batch_is_refused_and_a_one_rank_mesh_needs_no_launcher():
    model = nn.Linear(4, 4)
    with pytest.raises(FxShardError, match=r"example_batch leaf batch is on the meta device; pass a real example"):
        fxshard.trace(model, mean_loss, torch.randn(2, 4, device="meta"))
    batch = torch.randn(2, 4)
    torch.manual_seed(0)
    alone = fxshard.shard(nn.Linear(4, 4), mean_loss, batch, mesh=fxshard.Mesh(dp=1))
    torch.manual_seed(0)
    plain = fxshard.shard(nn.Linear(4, 4), mean_loss, batch)
    assert torch.equal(alone(batch)["loss"], plain(batch)["loss"])


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
    with pytest.raises(fxshard.FxShardError, match="Mesh\\(ep=2\\) but the model has no MoE layer: its traced forward routes no token"):
        fxshard.check(model, lambda m, b: m.loss(b), batch, mesh=fxshard.Mesh(dp=2, ep=2))
    with pytest.raises(fxshard.FxShardError, match="mesh must be fxshard.Mesh"):
        fxshard.check(model, lambda m, b: m.loss(b), batch, mesh="dp=2")
    fxshard.check(model, lambda m, b: m.loss(b), batch, mesh=fxshard.Mesh(dp=2))  # fine: returns quietly


def test_a_model_on_another_device_than_its_batch_is_named_before_tracing():
    from torch._subclasses.fake_tensor import FakeTensorMode

    model = nn.Linear(4, 1)
    with FakeTensorMode(allow_non_fake_inputs=True):  # a CUDA weight, without a GPU
        model.weight = nn.Parameter(torch.empty(1, 4, device="cuda"))
    with pytest.raises(FxShardError, match=r"model's tensors are on cuda:0 but the example batch is on cpu"):
        fxshard.shard(model, lambda m, b: m(b["x"]).sum(), {"x": torch.randn(2, 4)})


@pytest.mark.parametrize("field, value, message", [
    ("cuda_graphs", "no", "cuda_graphs must be True or False"),  # a string would read as True
    ("fuse_grad_accumulation", 1, "fuse_grad_accumulation must be True or False"),
    ("nccl_high_priority", "yes", "nccl_high_priority must be True or False"),
    ("direct_calls", "off", "direct_calls must be True or False"),
    ("microbatches", True, "microbatches must be an int"),
    ("layers", 5, "layers must be a module path pattern"),
    ("stage_layers", 4, "stage_layers must list ints"),
    ("clip_grad_norm", "1.0", "clip_grad_norm must be > 0"),
    ("nccl_max_ctas", 0, "nccl_max_ctas must be an int from 1 to 64"),
    ("nccl_max_ctas", True, "nccl_max_ctas must be an int from 1 to 64"),
    ("nccl_max_ctas", {"tp": 2}, "nccl_max_ctas must be an int from 1 to 64.*a dict of mesh axis"),
    ("nccl_max_ctas", {"pp": 0}, "nccl_max_ctas must be an int from 1 to 64"),
    ("nccl_max_ctas", [2], "nccl_max_ctas must be an int from 1 to 64"),
    ("p2p_receives", "eager", "p2p_receives='eager'; choose one of"),
    ("dump_dir", 5, "dump_dir must be a directory path"),
    ("check_initial_weights", "no", "check_initial_weights must be True or False"),
    ("seed", 1.5, "seed must be an int"),
    ("collective_timeout_s", float("inf"), r"collective_timeout_s must be a number of seconds > 0 \(finite"),
    ("share_compile", "yes", "share_compile='yes'; choose True, False or None"),
    ("param_dtype", torch.float8_e4m3fn, "param_dtype must be one of torch.bfloat16, torch.float16"),
    ("reduce_dtype", torch.float8_e5m2, "reduce_dtype must be one of"),
    ("param_dtype", torch.int8, "param_dtype must be one of")])
def test_config_fields_of_the_wrong_type_are_refused(field, value, message):
    with pytest.raises(fxshard.FxShardError, match=message):
        fxshard.Config(**{field: value})


def test_fp16_compute_scales_the_loss_by_default_and_warns_when_told_not_to():
    import warnings

    for field in ("param_dtype", "reduce_dtype"):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            config = fxshard.Config(**{field: torch.float16})
        assert config.loss_scaling() == fxshard.LossScale() and config.nonfinite_mode() == "skip"
        with pytest.warns(UserWarning, match=r"loss_scale=False\): without loss scaling, .* torch.bfloat16 has float32"):
            fxshard.Config(**{field: torch.float16}, loss_scale=False)


@pytest.mark.parametrize("make, message", [
    (lambda: fxshard.optim.AdamW(weight_decay=float("nan")), "AdamW weight_decay must be a finite number"),
    (lambda: fxshard.optim.AdamW(eps=float("nan")), "AdamW eps must be a finite number"),
    (lambda: fxshard.optim.AdamW(weight_decay="0.1"), "AdamW weight_decay must be a finite number"),
    (lambda: fxshard.optim.AdamW(weight_decay=-0.1), "AdamW weight_decay must be a finite number >= 0"),
    (lambda: fxshard.optim.AdamW(betas=(0.9,)), "AdamW betas must be two numbers"),
    (lambda: fxshard.optim.AdamW(lr=float("nan")), "lr must be a non-negative float"),
    (lambda: fxshard.optim.SGD(momentum=float("nan")), "SGD momentum must be a finite number")])
def test_optimizer_hyperparameters_torch_would_refuse_are_refused(make, message):
    """A NaN weight decay or eps makes every parameter NaN at the first update while the gradients
    stay finite, which the non-finite guard (it checks gradients) cannot see."""
    with pytest.raises(fxshard.FxShardError, match=message):
        make()


def test_nccl_max_ctas_per_axis_limits_only_the_axes_it_names():
    import dataclasses

    config = fxshard.Config(nccl_max_ctas={"pp": 2, "dp": 8})
    assert (config.nccl_ctas("pp"), config.nccl_ctas("dp"), config.nccl_ctas("ep")) == (2, 8, None)
    assert hash(config) == hash(dataclasses.replace(config))  # kept hashable, and replace() keeps it
    assert dataclasses.replace(config, seed=1).nccl_ctas("pp") == 2
    assert fxshard.Config(nccl_max_ctas=4).nccl_ctas("ep") == 4 and fxshard.Config().nccl_ctas("pp") is None
    assert fxshard.Config(nccl_max_ctas={}) == fxshard.Config()  # limits nothing: the default


def test_a_parameter_clamped_in_place_in_forward_is_named_as_such_not_as_a_non_scalar_loss():
    class Clamped(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(4, 1)

        def forward(self, x):
            with torch.no_grad():
                self.linear.weight.clamp_(-1, 1)  # a weight constraint, written in place
            return self.linear(x)

    with pytest.raises(fxshard.FxShardError, match="the forward mutates parameter 'linear.weight' in place.*parametriz"):
        fxshard.trace(Clamped(), lambda m, b: m(b["x"]).square().mean(), {"x": torch.randn(8, 4)})


class _FrozenBias(nn.Module):
    """DeepSeek-V3's score-correction bias kept as a frozen Parameter, updated in the forward."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.bias = nn.Parameter(torch.zeros(4), requires_grad=False)

    def forward(self, x):
        y = self.lin(x)
        with torch.no_grad():
            self.bias.add_(0.01 * torch.sign(y.mean(0)))
        return y + self.bias


class _PlainTensorAttribute(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.scale = nn.Linear(4, 4), torch.tensor(2.0)

    def forward(self, x):
        return self.lin(x) * self.scale


class _BackwardHookUpdate(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("seen", torch.zeros(()))
        self.register_full_backward_hook(lambda module, grad_in, grad_out: module.seen.add_(grad_out[0].sum()))

    def forward(self, x):
        return self.lin(x)


@pytest.mark.parametrize("model, expected", [
    (_FrozenBias(), "mutates parameter 'bias' in place.*register_buffer\\('bias'"),
    (_PlainTensorAttribute(), "reads a real tensor that is neither a parameter.*self.lin\\(x\\) \\* self.scale.*register"),
    (_BackwardHookUpdate(), "updates in place a tensor it does not carry.*backward hook.*register_buffer"),
])
def test_state_kept_or_updated_where_the_step_cannot_carry_it_is_named_with_the_fix(model, expected):
    with pytest.raises(fxshard.FxShardError, match=re.compile(expected, re.S)):
        fxshard.trace(model, lambda m, b: m(b["x"]).square().mean(), {"x": torch.randn(8, 4)})


def _all_reduce_in_forward_job():
    import torch.distributed as dist

    class Counting(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.register_buffer("counts", torch.zeros(4))

        def forward(self, x):
            y = self.lin(x)
            with torch.no_grad():
                counts = y.detach().sum(0)
                dist.all_reduce(counts)  # in place: an effectful op the trace cannot order
                self.counts.add_(counts)
            return y
    try:
        fxshard.trace(Counting(), lambda m, b: m(b["x"]).square().mean(), {"x": torch.randn(8, 4)})
    except FxShardError as error:
        return str(error)


def test_an_in_place_collective_in_the_forward_names_the_functional_one():
    (message,) = run_local(_all_reduce_in_forward_job, 1, backend="gloo")
    assert "in-place torch.distributed collective" in message and "_functional_collectives.all_reduce" in message


def test_a_dump_directory_that_cannot_be_made_is_refused_before_compiling(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(fxshard.FxShardError, match=r"Config\(dump_dir=.*\) cannot be made"):
        fxshard.shard(torch.nn.Linear(2, 1), lambda m, b: m(b["x"]).sum(), {"x": torch.randn(2, 2)},
                      config=fxshard.Config(dump_dir=str(tmp_path / "file" / "dumps")))
    for environment, said in ((tmp_path / "file" / "dumps", r"FXSHARD_DUMP='.*' cannot be made"),
                              (tmp_path / "file", r"the environment's FXSHARD_DUMP: dump_dir .* is a file")):
        with pytest.MonkeyPatch.context() as patch, pytest.raises(fxshard.FxShardError, match=said):
            patch.setenv("FXSHARD_DUMP", str(environment))  # named where it came from
            fxshard.shard(torch.nn.Linear(2, 1), lambda m, b: m(b["x"]).sum(), {"x": torch.randn(2, 2)})
    (tmp_path / "existing").mkdir()
    with pytest.MonkeyPatch.context() as patch, pytest.raises(
            fxshard.FxShardError, match=r"Config\(dump_dir=.*\) exists but this process cannot write in it"):
        patch.setattr(fxshard.api.os, "access", lambda path, mode: False)  # (a root process passes mode bits)
        fxshard.shard(torch.nn.Linear(2, 1), lambda m, b: m(b["x"]).sum(), {"x": torch.randn(2, 2)},
                      config=fxshard.Config(dump_dir=str(tmp_path / "existing")))
    with pytest.raises(fxshard.FxShardError, match=r"Schedule.from_json\(open\(path\).read\(\)\)"):
        fxshard.schedule.Schedule.from_json("schedule.json")
    with pytest.raises(fxshard.FxShardError, match="needs a number of processes >= 1, got 0"):
        run_local(print, 0)


def test_pipeline_settings_without_a_pipeline_are_said_to_do_nothing():
    """A run that meant to pipeline but forgot the mesh trains on one device: shard and check say so."""
    batch = {"idx": torch.zeros(2, 8, dtype=torch.long), "tgt": torch.zeros(2, 8, dtype=torch.long)}
    with pytest.warns(UserWarning, match=r"Config\(schedule='zb-h1', stage_layers=\(1, 1\)\) shapes a pipeline, but "
                                         r"the mesh \(one device\) has no pp axis"):
        fxshard.check(GPT(GPTConfig.preset("tiny")), lambda m, b: m.loss(b), batch,
                      config=fxshard.Config(schedule="zb-h1", stage_layers=(1, 1)))


def test_a_parameter_gradient_hook_or_a_complex_parameter_is_refused_not_skipped():
    """A hook on a parameter tensor belongs to that tensor, which the traced step never differentiates:
    it was skipped silently (a hook zeroing the gradient still let the weight train)."""
    hooked = nn.Linear(4, 4)
    hooked.weight.register_hook(lambda grad: grad * 0)
    with pytest.raises(FxShardError, match=r"parameter 'weight' has a gradient hook \(register_hook\)"):
        fxshard.trace(hooked, mean_loss, torch.randn(2, 4))
    accumulating = nn.Linear(4, 4)
    accumulating.bias.register_post_accumulate_grad_hook(lambda param: None)
    with pytest.raises(FxShardError, match="'bias' has a gradient hook \\(register_post_accumulate_grad_hook\\)"):
        fxshard.trace(accumulating, mean_loss, torch.randn(2, 4))
    complex_model = nn.Linear(4, 4)
    complex_model.extra = nn.Parameter(torch.zeros(4, dtype=torch.complex64))
    with pytest.raises(FxShardError, match="'extra' is complex .* torch.view_as_real"):
        fxshard.trace(complex_model, mean_loss, torch.randn(2, 4))


def test_mixed_integer_matmuls_sparse_embeddings_lr_schedules_and_config_flags_are_refused_early():
    """A helper's review: these failed only in the first step (with a hint about the batch) or not at all."""
    with pytest.raises(FxShardError, match=r"multiplies torch.float32 by torch.int64 .*\.float\(\)"):
        fxshard.trace(nn.Linear(4, 4), mean_loss, torch.randint(0, 4, (2, 4)))
    sparse = nn.Sequential(nn.Embedding(8, 4, sparse=True))
    with pytest.raises(FxShardError, match=r"^0 is an Embedding with sparse=True"):
        fxshard.trace(sparse, mean_loss, torch.randint(0, 8, (2, 4)))
    with pytest.raises(FxShardError, match=r"cannot be called as lr\(step\)"):
        fxshard.optim.AdamW(lr=lambda: 1e-3)
    fxshard.optim.SGD(lr=lambda step, warmup=10: 1e-3)  # one positional argument is all it needs
    for settings in ({"wait_marks": "no"}, {"moe_capacity_factor": True}, {"ep_sm_carveout": True}):
        with pytest.raises(FxShardError, match=next(iter(settings))):
            fxshard.Config(**settings)
    with pytest.raises(FxShardError, match=r"Mesh\(dp=True\)"):
        fxshard.Mesh(dp=True)


def test_a_hook_on_a_frozen_parameter_never_runs_so_it_is_no_reason_to_refuse():
    model = nn.Linear(4, 4)
    model.bias.register_hook(lambda grad: grad * 0)
    model.bias.requires_grad_(False)
    assert fxshard.trace(model, mean_loss, torch.randn(2, 4)) is not None


def test_moe_settings_on_a_model_without_moe_layers_are_said_to_do_nothing():
    batch = {"idx": torch.zeros(2, 8, dtype=torch.long), "tgt": torch.zeros(2, 8, dtype=torch.long)}
    config = fxshard.Config(fuse_grouped_mlp=True, moe_capacity_factor=1.0)
    with pytest.warns(UserWarning, match=r"Config\(fuse_grouped_mlp=True, moe_capacity_factor=1.0\) acts on MoE "
                                         r"layers, but the step has none"):
        fxshard.check(GPT(GPTConfig.preset("tiny")), lambda m, b: m.loss(b), batch, config=config)
    import warnings

    from fxshard.models import MoEGPT, MoEGPTConfig

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # MoEGPT's dispatch calls: they act, and its expert MLPs fuse
        fxshard.check(MoEGPT(MoEGPTConfig.preset("tiny")), lambda m, b: m.loss(b), batch, config=config)
    # torchtitan's experts run gate and up as two grouped GEMMs, which the fused op (one GEMM, then
    # the gated activation) does not take: the setting acts on nothing there, and says so
    from model_zoo import masked_batches, titan_deepseek_v3, titan_loss

    with pytest.warns(UserWarning, match=r"fuse_grouped_mlp=True\) fused none of the step's expert MLPs"):
        fxshard.check(titan_deepseek_v3(), titan_loss, masked_batches("titan_deepseek_v3", 1)[0],
                      config=fxshard.Config(fuse_grouped_mlp=True))


class DetachedScale(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.ones(4))

    def forward(self, x):
        return self.lin(x) * self.scale.detach()  # read, but no gradient reaches it


def test_a_parameter_read_only_through_detach_is_named_with_freezing_as_the_fix():
    batch = {"x": torch.randn(2, 4), "y": torch.randn(2, 4)}
    with pytest.raises(FxShardError, match=r"parameter 'scale' requires grad but the loss does not depend on it "
                                           r"\(not read in the forward, or read only through \.detach\(\)"):
        fxshard.trace(DetachedScale(), lambda m, b: nn.functional.mse_loss(m(b["x"]), b["y"]), batch)


def test_every_parameter_without_a_gradient_is_named_at_once_with_a_loop_that_freezes_them():
    """DeepSeek-V3.2's indexer weights feed only a top-k: no gradient, in every layer. One error names
    them all, as patterns over the layers, with a loop that freezes them; after it the step traces."""
    import fnmatch  # noqa: F401  (the message's loop uses it)

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.indexer = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x):
            chosen = self.indexer(x).topk(2, dim=-1).indices  # an index only: no gradient
            return self.lin(x) + x.gather(-1, chosen).sum(-1, keepdim=True)

    model = nn.Sequential(Layer(), Layer(), Layer())
    batch = {"x": torch.randn(2, 4), "y": torch.randn(2, 4)}

    def loss(m, b):
        return nn.functional.mse_loss(m(b["x"]), b["y"])
    with pytest.raises(FxShardError, match=r"6 parameters require grad but the loss does not depend on them .*"
                                           r"0\.indexer\.weight, 0\.indexer\.bias, 1\.indexer\.weight") as raised:
        fxshard.trace(model, loss, batch)
    assert "['*.indexer.weight', '*.indexer.bias']" in str(raised.value)  # the layers' index as *
    fix = re.search(r"`(for name, p in .*)`", str(raised.value)).group(1)
    exec(fix, {"model": model, "fnmatch": __import__("fnmatch")})
    assert sorted(n for n, p in model.named_parameters() if not p.requires_grad) == \
        [f"{i}.indexer.{k}" for i in range(3) for k in ("bias", "weight")]
    fxshard.trace(model, loss, batch)
    class Graded(Layer):  # its indexer's scores reach the loss too: a gradient
        def forward(self, x):
            return super().forward(x) + self.indexer(x).mean(-1, keepdim=True)

    model = nn.Sequential(Layer(), Graded(), Graded())  # layer 0 alone gives its indexer no gradient
    with pytest.raises(FxShardError, match=r"2 parameters require grad") as raised:
        fxshard.trace(model, loss, batch)
    assert "['0.indexer.weight', '0.indexer.bias']" in str(raised.value)  # '*' would freeze layers 1 and 2's
    exec(re.search(r"`(for name, p in .*)`", str(raised.value)).group(1), {"model": model, "fnmatch": __import__("fnmatch")})
    assert sorted(n for n, p in model.named_parameters() if not p.requires_grad) == ["0.indexer.bias", "0.indexer.weight"]


def test_a_host_read_inside_a_torch_module_names_its_line_and_batchnorms_fix():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4, momentum=None))
    batch = {"x": torch.randn(8, 4), "y": torch.randn(8, 4)}
    with pytest.raises(FxShardError, match=r"inside torch\.nn\.modules\.batchnorm:\d+ in forward: .*num_batches_tracked"
                                           r"(.|\n)*give it a numeric momentum"):
        fxshard.trace(model, lambda m, b: nn.functional.mse_loss(m(b["x"]), b["y"]), batch)


def test_a_host_read_in_the_users_own_module_names_no_torch_line():
    batch = {"x": torch.randn(2, 4), "y": torch.randn(2, 4)}
    with pytest.raises(FxShardError) as error:
        fxshard.trace(ReadsItem(), lambda m, b: nn.functional.mse_loss(m(b["x"]), b["y"]), batch)
    assert "scale = x.abs().max().item()" in str(error.value) and "inside torch.nn" not in str(error.value)
