"""Config(loss_scale): the loss is scaled before the backward and the gradients unscaled in the
optimizer phase, static (a constant of the program) or dynamic (torch.amp.GradScaler's rule, state
the step carries, checkpoints save and load)."""

import copy
import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

import fxshard
from fxshard.models import GPT, GPTConfig
from fxshard.passes.fsdp import FSDPConfig, fsdp
from fxshard.program import InputKind, OutputKind
from fxshard.runtime.nonfinite import was_skipped
from fxshard.testing import SimulatedRanks, torch_optimizer
from test_nonfinite import Regressor, regression_batches

ADAMW = fxshard.optim.AdamW(lr=1e-2, weight_decay=0.1)


def weighted_loss(model, batch):  # batch["w"] multiplies the loss: a large one overflows the scaled gradients
    return ((model(batch["x"]) - batch["y"]) ** 2).mean() * batch["w"]


def weighted(batches, weights):
    return [dict(batch, w=torch.tensor(weight)) for batch, weight in zip(batches, weights)]


def test_a_dynamic_scale_backs_off_grows_and_skips_as_grad_scaler_does():
    """fp16 compute on fp32 masters: fxshard's step against an eager fp16 copy stepped through
    torch.amp.GradScaler. The loss is large enough that 2**16 overflows the fp16 gradients at first,
    so the first steps back off, and growth_interval=2 makes later ones grow again: the scale, which
    steps are skipped and the losses follow GradScaler's step for step."""
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny"))
    generator = torch.Generator().manual_seed(0)
    batches = [{"idx": torch.randint(0, 64, (4, 16), generator=generator),
                "tgt": torch.randint(0, 64, (4, 16), generator=generator)} for _ in range(8)]

    def loss_fn(model, batch):
        return model.loss(batch) * 20.0

    optimizer = fxshard.optim.AdamW(lr=1e-3)
    config = fxshard.Config(param_dtype=torch.float16, loss_scale=fxshard.LossScale(growth_interval=2))
    step = fxshard.shard(copy.deepcopy(model), loss_fn, batches[0], optimizer=optimizer, config=config)
    assert [spec.kind for spec in step.program.inputs].count(InputKind.LOSS_SCALE) == 1
    assert step.program.outputs_of(OutputKind.LOSS_SCALE) and step.loss_scale == 2.0 ** 16
    reference = GradScalerReference(model, loss_fn, optimizer, config.loss_scale, "cpu")
    scales, skips = [], []
    for batch in batches:
        eager, skipped, scale = reference.step(batch)
        metrics = step(batch)
        assert abs(metrics["loss"].item() - eager.item()) <= 2e-3 * abs(eager.item())
        assert bool(metrics["skipped"]) == skipped
        assert step.loss_scale == scale
        scales.append(step.loss_scale)
        skips.append(bool(metrics["skipped"]))
    assert any(skips) and not all(skips) and max(scales[skips.index(False):]) > min(scales)  # backed off, then grew
    assert step.skipped_steps == sum(skips)
    for (name, ours), theirs in zip(step.parameters().items(), reference.master.parameters()):
        assert torch.allclose(ours, theirs, rtol=1e-2, atol=1e-3), name


class GradScalerReference:
    """Eager PyTorch's fp16 recipe: an fp16 copy of fp32 masters runs the forward and backward of the
    loss scaled by torch.amp.GradScaler, whose step and update drive a torch.optim optimizer."""

    def __init__(self, model, loss_fn, optimizer, scale: fxshard.LossScale, device: str):
        self.master, self.low, self.loss_fn = copy.deepcopy(model), copy.deepcopy(model).half(), loss_fn
        self.optimizer = torch_optimizer(optimizer, self.master.parameters())
        self.scaler = torch.amp.GradScaler(device, init_scale=scale.init_scale, growth_factor=scale.growth_factor,
                                           backoff_factor=scale.backoff_factor, growth_interval=scale.growth_interval)

    def step(self, batch):
        """One step: (the fp16 loss, whether the step was skipped, the scale after it)."""
        with torch.no_grad():
            for p16, p in zip(self.low.parameters(), self.master.parameters()):
                p16.copy_(p)
        self.low.zero_grad()
        loss = self.loss_fn(self.low, batch)
        self.scaler.scale(loss).backward()
        for p16, p in zip(self.low.parameters(), self.master.parameters()):
            p.grad = p16.grad.float()
        before = self.scaler.get_scale()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        return loss, self.scaler.get_scale() < before, self.scaler.get_scale()


@settings(max_examples=max(2, settings.default.max_examples // 2), deadline=None)  # ~2 s an example
@given(exponent=st.integers(-6, 24), clip=st.sampled_from([None, 0.05]),
       sharding=st.sampled_from([None, "optim", "optim_grads_params"]))
def test_a_power_of_two_static_scale_changes_no_bit_of_an_fp32_step(exponent, clip, sharding):
    """Scaling by 2**k and unscaling by 2**-k is exact while no value leaves fp32's range: the losses
    and updated parameters equal those of the unscaled program bit for bit, also with the gradient norm
    clipped (where the unscaling folds into the clip coefficient) and under ZeRO-1 or ZeRO-3 over two ranks."""
    torch.manual_seed(0)
    model = Regressor()
    batches = regression_batches(3, rows=4)

    def run(loss_scale):
        config = fxshard.Config(loss_scale=loss_scale, clip_grad_norm=clip)
        if sharding is None:
            step = fxshard.shard(copy.deepcopy(model), _plain, batches[0],
                                 optimizer=ADAMW, config=config)
            losses = [step(batch)["loss"] for batch in batches]
            return losses, step.parameters()
        halves = [[{k: v[:2] for k, v in batch.items()}, {k: v[2:] for k, v in batch.items()}] for batch in batches]
        program = fsdp(fxshard.trace(model, _plain, halves[0][0], optimizer=ADAMW, config=config),
                       FSDPConfig(2, sharding))
        ranks = SimulatedRanks(program, model, ADAMW, fxshard.Mesh(dp=2))
        losses = [ranks.step(pair)[0]["loss"] for pair in halves]
        return losses, ranks.parameters(0)

    scaled, unscaled = run(2.0 ** exponent), run(None)
    for ours, theirs in zip(scaled[0], unscaled[0]):
        assert torch.equal(ours, theirs)
    for name, value in unscaled[1].items():
        assert torch.equal(scaled[1][name], value), (name, exponent)


def _plain(model, batch):
    return ((model(batch["x"]) - batch["y"]) ** 2).mean()


def test_a_dynamic_scale_under_zero3_matches_one_device_and_survives_a_checkpoint(tmp_path):
    """fp32 with Config(loss_scale="dynamic"): a step whose scaled gradients overflow (a loss weight of
    1e35 times 2**16) is skipped and the scale halved, on every rank alike; two applied steps in a row
    double it. ZeRO-3 over two simulated ranks follows the single-device step's scale and parameters,
    and a checkpoint saved mid-count carries the scale and its count of good steps into a fresh step."""
    torch.manual_seed(0)
    model = Regressor()
    weights = [1.0, 1e35, 1.0, 1.0, 1e35, 1.0]
    batches = weighted(regression_batches(len(weights), rows=4), weights)
    config = fxshard.Config(loss_scale=fxshard.LossScale(growth_interval=2))
    assert config.nonfinite_mode() == "skip"
    single = fxshard.shard(copy.deepcopy(model), weighted_loss, batches[0], optimizer=ADAMW, config=config)
    program = fsdp(fxshard.trace(model, weighted_loss, {k: v[:2] if v.dim() else v for k, v in batches[0].items()},
                                 optimizer=ADAMW, config=config), FSDPConfig(2, "optim_grads_params"))
    ranks = SimulatedRanks(program, model, ADAMW, fxshard.Mesh(dp=2))
    scales, skips = [], []
    for index, batch in enumerate(batches):
        if index == 3:  # scale 2**15 after one good step: a fresh step would start at 2**16 with none
            fxshard.save(single, tmp_path / "ck")
        metrics = single(batch)
        skips.append(bool(metrics["skipped"]))
        scales.append(single.loss_scale)
        sharded = ranks.step([{k: v[half] if v.dim() else v for k, v in batch.items()}
                              for half in (slice(0, 2), slice(2, 4))])
        assert [bool(was_skipped(m["nonfinite"])) for m in sharded] == [skips[-1]] * 2
        assert all(float(ranks.states[r][InputKind.LOSS_SCALE, "loss_scale"][0]) == scales[-1] for r in range(2))
    assert skips == [False, True, False, False, True, False]
    assert scales == [2.0 ** 16, 2.0 ** 15, 2.0 ** 15, 2.0 ** 16, 2.0 ** 15, 2.0 ** 15]
    for name, value in single.parameters().items():
        assert torch.allclose(ranks.parameters(0)[name], value, rtol=1e-5, atol=1e-6), name

    resumed = fxshard.shard(copy.deepcopy(model), weighted_loss, batches[0], optimizer=ADAMW, config=config)
    assert resumed.loss_scale == 2.0 ** 16
    fxshard.load(resumed, tmp_path / "ck")
    assert resumed.loss_scale == 2.0 ** 15 and resumed.step_count == 3
    assert [(resumed(batch), resumed.loss_scale)[1] for batch in batches[3:]] == scales[3:]  # grows at once
    for name, value in single.parameters().items():
        assert torch.equal(resumed.parameters()[name], value), name


@pytest.mark.parametrize("config, message", [
    (dict(loss_scale="static"), "loss_scale='static'; choose \"dynamic\""),
    (dict(loss_scale=0.0), r"a number in \[2\*\*-126, 2\*\*126\]"),
    (dict(loss_scale=math.inf), r"a number in \[2\*\*-126, 2\*\*126\]"),
    (dict(loss_scale=1e39), r"a number in \[2\*\*-126, 2\*\*126\]"),   # inf in float32
    (dict(loss_scale=1e-50), r"a number in \[2\*\*-126, 2\*\*126\]"),  # 0 in float32
    (dict(loss_scale="dynamic", nonfinite="raise"), "nonfinite='raise' with a dynamic loss scale"),
    (dict(param_dtype=torch.float16, nonfinite="ignore"), "nonfinite='ignore' with a dynamic loss scale")])
def test_loss_scales_the_step_cannot_apply_are_refused(config, message):
    with pytest.raises(fxshard.FxShardError, match=message):
        fxshard.Config(**config)


@pytest.mark.parametrize("make, message", [
    (lambda: fxshard.LossScale(init_scale=0), "init_scale must be a number in"),
    (lambda: fxshard.LossScale(init_scale=1e-50), "init_scale must be a number in"),  # 0 in float32: every step skipped
    (lambda: fxshard.LossScale(growth_interval=2 ** 25), r"growth_interval must be an int in \[1, 2\*\*24\]"),
    (lambda: fxshard.LossScale(growth_factor=1.0), "growth_factor must be a number > 1"),
    (lambda: fxshard.LossScale(backoff_factor=1.5), "backoff_factor must be a number in"),
    (lambda: fxshard.LossScale(growth_interval=0), r"growth_interval must be an int in \[1, 2\*\*24\]")])
def test_loss_scale_parameters_grad_scaler_would_refuse_are_refused(make, message):
    with pytest.raises(fxshard.FxShardError, match=message):
        make()


@pytest.mark.parametrize("dp, sharding, last, schedule", [
    (1, "no_shard", "pipeline", "interleaved-1f1b"), (2, "no_shard", "fsdp", "interleaved-1f1b"),
    (2, "optim_grads_params", "fsdp", "interleaved-1f1b"),
    (1, "no_shard", "pipeline", "zb-h1"),       # W actions: the weight gradients reuse the backward's inputs
    (1, "no_shard", "pipeline", "dualpipev")])  # the V: the loss chunk is on rank 0
def test_a_dynamic_scale_inside_a_pipeline_follows_the_single_device_step(dp, sharding, last, schedule):
    """Mesh(pp=2), the lowered schedule's own optimizer phase (`last="pipeline"`), or Mesh(pp=2, dp=2)
    under DDP or ZeRO-3, whose pass rebuilds that phase: the chunk with the loss reads the scale,
    every stage unscales with it and updates it alike (the skip follows the norm summed over the
    stages). A step where one microbatch's weight overflows the scaled gradients is skipped on every
    rank; scale, skips and parameters follow fxshard's single-device step on the same microbatches."""
    from fxshard.loss_scale import NAME as LOSS_SCALE_NAME
    from fxshard.passes import run_pipeline
    from fxshard.passes.pipeline import split_stages

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=40, d_model=16, n_layer=4, n_head=2, d_ff=24))

    def loss_fn(model, batch):  # the rows' weights: 1e35 overflows the scaled fp32 gradients
        return model.loss({"idx": batch["idx"], "tgt": batch["tgt"]}) * batch["w"].mean()

    generator = torch.Generator().manual_seed(1)
    weights = [[1.0] * 4, [1.0, 1e35, 1.0, 1.0], [1.0] * 4, [1.0] * 4]
    steps = [[{"idx": torch.randint(0, 40, (2, 8), generator=generator),
               "tgt": torch.randint(0, 40, (2, 8), generator=generator), "w": torch.full((2,), w)} for w in row]
             for row in weights]
    scale = fxshard.LossScale(init_scale=2.0 ** 10, growth_interval=1)
    mesh, config = fxshard.Mesh(pp=2, dp=dp), fxshard.Config(
        microbatches=4 // dp, schedule=schedule, virtual_stages=1 if schedule == "zb-h1" else 2, sharding=sharding,
        loss_scale=scale)
    program = fxshard.trace(model, loss_fn, steps[0][0], optimizer=ADAMW, config=fxshard.Config(loss_scale=scale))
    stages = [next(p for p in run_pipeline(program, mesh, config, stage=stage) if p.name == last)
              for stage in range(mesh.pp)]
    assert all(stage.outputs_of(OutputKind.LOSS_SCALE) for stage in stages)
    chunks = split_stages(program, 4).chunks  # the loss chunk alone takes the scale, beside its parameters
    assert [c.loss_scale for c in chunks] == [c.has_loss for c in chunks] == [False, False, False, True]
    assert not any(LOSS_SCALE_NAME in c.params for c in chunks)
    ranks = SimulatedRanks(stages, model, ADAMW, mesh)
    single = fxshard.shard(copy.deepcopy(model), loss_fn, _joined(steps[0]), optimizer=ADAMW,
                           config=fxshard.Config(microbatches=4, loss_scale=scale))
    skips = []
    for pieces in steps:
        metrics = single(_joined(pieces))
        skips.append(bool(metrics["skipped"]))
        parts = [_joined(pieces[:2]), _joined(pieces[2:])] if dp == 2 else [_joined(pieces)]
        sharded = ranks.step([parts[mesh.coords(rank)["dp"]] for rank in range(mesh.size)])
        assert [bool(was_skipped(m["nonfinite"])) for m in sharded] == [skips[-1]] * mesh.size
        assert [float(state[InputKind.LOSS_SCALE, "loss_scale"][0]) for state in ranks.states] == \
            [single.loss_scale] * mesh.size
        if not skips[-1]:
            assert all(abs(m["loss"].item() - metrics["loss"].item()) <= 1e-5 * metrics["loss"].item() for m in sharded)
    assert skips == [False, True, False, False] and single.loss_scale == 2.0 ** 12  # grew, halved, grew twice
    for name, value in single.parameters().items():
        assert torch.allclose(ranks.parameters(mesh.size - 1)[name], value, rtol=1e-5, atol=1e-6), name


def _joined(pieces):
    return {key: torch.cat([piece[key] for piece in pieces]) for key in pieces[0]}


class Named(torch.nn.Module):
    """A regressor whose top-level gain parameter is named like one of the step's own inputs."""

    def __init__(self, name):
        super().__init__()
        self.name, self.inner = name, Regressor()
        self.register_parameter(name, torch.nn.Parameter(torch.full((), 1.5)))

    def forward(self, x):
        return self.inner(x) * getattr(self, self.name)


@pytest.mark.parametrize("name", ["loss_scale", "lr", "step"])
def test_a_parameter_named_like_one_of_the_steps_own_inputs_trains_as_under_any_other_name(name):
    """The passes find the step's own inputs (lr, step, the loss scale's state) by kind, not by name:
    a top-level parameter called `lr`, `step` or `loss_scale` trains bit for bit as one called `gain`,
    under a dynamic loss scale, on one device and under ZeRO-3 over two simulated ranks."""
    torch.manual_seed(0)
    batches = weighted(regression_batches(3, rows=4), [1.0, 1e35, 1.0])
    config = fxshard.Config(loss_scale=fxshard.LossScale(growth_interval=1))
    results = []
    for label in (name, "gain"):
        torch.manual_seed(0)
        model = Named(label)
        single = fxshard.shard(copy.deepcopy(model), weighted_loss, batches[0], optimizer=ADAMW, config=config)
        program = fsdp(fxshard.trace(model, weighted_loss, {k: v[:2] if v.dim() else v for k, v in batches[0].items()},
                                     optimizer=ADAMW, config=config), FSDPConfig(2, "optim_grads_params"))
        ranks = SimulatedRanks(program, model, ADAMW, fxshard.Mesh(dp=2))
        losses = []
        for batch in batches:
            losses.append(single(batch)["loss"])
            ranks.step([{k: v[half] if v.dim() else v for k, v in batch.items()} for half in (slice(0, 2), slice(2, 4))])
        params = {key.replace(label, "<gain>"): value for key, value in single.parameters().items()}
        sharded = {key.replace(label, "<gain>"): value for key, value in ranks.parameters(0).items()}
        results.append((losses, params, sharded, single.loss_scale, single.step_count))
    ours, theirs = results
    assert ours[3:] == theirs[3:] and all(torch.equal(a, b) for a, b in zip(ours[0], theirs[0]))
    for key, value in theirs[1].items():
        assert torch.equal(ours[1][key], value) and torch.equal(ours[2][key], theirs[2][key]), key


def test_a_parameter_named_loss_scale_in_a_pipeline_trains_as_under_any_other_name():
    """Mesh(pp=2) under a dynamic scale: the last chunk reads both the parameter `loss_scale` and the
    scale's state, which `Chunk.loss_scale` hands it apart from its parameters."""
    from fxshard.passes import run_pipeline

    class Gained(torch.nn.Module):
        def __init__(self, name):
            super().__init__()
            self.name, self.gpt = name, GPT(GPTConfig(vocab_size=40, d_model=16, n_layer=2, n_head=2, d_ff=24))
            self.register_parameter(name, torch.nn.Parameter(torch.full((), 1.5)))

        def loss(self, batch):
            return self.gpt.loss(batch) * getattr(self, self.name)

    generator = torch.Generator().manual_seed(1)
    pieces = [{"idx": torch.randint(0, 40, (2, 8), generator=generator),
               "tgt": torch.randint(0, 40, (2, 8), generator=generator)} for _ in range(2)]
    config, mesh = fxshard.Config(loss_scale=fxshard.LossScale()), fxshard.Mesh(pp=2)
    results = []
    for name in ("loss_scale", "gain"):
        torch.manual_seed(0)
        model = Gained(name)
        program = fxshard.trace(model, lambda m, b: m.loss(b), pieces[0], optimizer=ADAMW, config=config)
        stages = [run_pipeline(program, mesh, dataclasses.replace(config, microbatches=2), stage=s)[-1]
                  for s in range(2)]
        ranks = SimulatedRanks(stages, model, ADAMW, mesh)
        losses = [ranks.step([_joined(pieces)] * 2)[0]["loss"] for _ in range(2)]
        results.append((losses, ranks.parameters(1)[name], ranks.parameters(1)["gpt.head.weight"]))
    (ours, theirs) = results
    assert all(torch.equal(a, b) for a, b in zip(ours[0], theirs[0]))
    assert torch.equal(ours[1], theirs[1]) and torch.equal(ours[2], theirs[2]) and ours[1].item() != 1.5


def test_a_pipeline_in_fp16_builds_with_its_dynamic_scale():
    """What api refused before pipelines carried the scale: the launcher's check passes."""
    batch = {"idx": torch.randint(0, 64, (4, 16)), "tgt": torch.randint(0, 64, (4, 16))}
    fxshard.check(GPT(GPTConfig.preset("tiny")), lambda m, b: m.loss(b), batch, mesh=fxshard.Mesh(pp=2),
                  config=fxshard.Config(param_dtype=torch.float16, microbatches=2))


@pytest.mark.parametrize("sharding, clip, optimizer", [
    ("optim_grads_params", None, ADAMW), ("optim", 0.05, fxshard.optim.SGD(lr=0.1, momentum=0.9))])
def test_a_dynamic_power_of_two_scale_under_expert_parallelism_changes_no_bit(sharding, clip, optimizer):
    """Mesh(dp=2, ep=2), whose ep pass rebuilds the optimizer phase (experts averaged over edp): the
    default dynamic scale (2**16, grown each step here) against no scale, with ZeRO-3 and AdamW or
    ZeRO-1, clipping and SGD (the multiply before the update): losses and parameters bit for bit."""
    from fxshard.models import MoEGPT, MoEGPTConfig
    from fxshard.passes import run_pipeline

    mesh = fxshard.Mesh(dp=2, ep=2)
    generator = torch.Generator().manual_seed(1)
    steps = [[{"idx": torch.randint(0, 16, (2, 4), generator=generator),
               "tgt": torch.randint(0, 16, (2, 4), generator=generator)} for _ in range(2)] for _ in range(3)]

    def run(loss_scale):
        torch.manual_seed(1)
        model = MoEGPT(MoEGPTConfig(vocab_size=16, d_model=8, n_layer=2, n_head=2, n_expert=4, top_k=2,
                                    d_ff_expert=8, d_ff_shared=None))
        config = fxshard.Config(sharding=sharding, loss_scale=loss_scale, clip_grad_norm=clip)
        programs = run_pipeline(fxshard.trace(model, lambda m, b: m.loss(b), steps[0][0], optimizer=optimizer,
                                              config=config), mesh, config)
        assert "ep" in [p.name for p in programs]
        ranks = SimulatedRanks(programs[-1], model, optimizer, mesh)
        return [ranks.step(local)[0]["loss"] for local in steps], ranks.parameters(1)

    (scaled_losses, scaled), (losses, plain) = run(fxshard.LossScale(growth_interval=1)), run(False)
    assert all(torch.equal(a, b) for a, b in zip(scaled_losses, losses))
    for name, value in plain.items():
        assert torch.equal(scaled[name], value), name
