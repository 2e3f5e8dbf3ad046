"""Config(nonfinite): a step whose gradients are not finite leaves parameters, optimizer state and buffers as
they were, on every rank alike; "skip" goes on, "raise" names the step and the parameter."""

import pytest
import torch
import torch.nn as nn
from hypothesis import given, strategies as st

import fxshard
from fxshard.models import GPT, GPTConfig, MoEGPT, MoEGPTConfig
from fxshard.passes import run_pipeline
from fxshard.testing import SimulatedRanks

ADAMW = fxshard.optim.AdamW(lr=1e-2, weight_decay=0.1)
SGD_MOMENTUM = fxshard.optim.SGD(lr=0.05, momentum=0.9)


class Regressor(nn.Module):
    def __init__(self, width=8, depth=2, norm=False):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.norm = nn.BatchNorm1d(width) if norm else nn.Identity()  # buffers the step updates
        self.head = nn.Linear(width, 1)

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.head(self.norm(x))


def regression_loss(model, batch):
    return ((model(batch["x"]) - batch["y"]) ** 2).mean()


def regression_batches(count, rows=4, width=8, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [{"x": torch.randn(rows, width, generator=generator), "y": torch.randn(rows, 1, generator=generator)}
            for _ in range(count)]


def guards(program) -> set:
    """The skip flags (not isfinite(grad norm)) that the optimizer updates of `program` read."""
    updates = (torch.ops.fxshard.adamw_update.default, torch.ops.aten.where.self)
    return {n for n in program.graph.nodes if n.target is torch.ops.aten.logical_not.default
            and any(user.target in updates for user in n.users)}


def poisoned(batch, key="x"):
    bad = {name: value.clone() for name, value in batch.items()}
    bad[key].view(-1)[1] = float("nan")
    return bad


@pytest.mark.parametrize("optimizer", [ADAMW, SGD_MOMENTUM], ids=["adamw", "sgd_momentum"])
def test_a_skipped_step_leaves_the_state_of_a_run_without_it(optimizer):
    """Parameters, optimizer state and the buffers the step updates (BatchNorm's running statistics,
    which a NaN batch would make NaN) end as in a run that never saw the skipped batch."""
    torch.manual_seed(0)
    model = Regressor(norm=True)
    good = regression_batches(3)
    skipping = fxshard.shard(model, regression_loss, good[0], optimizer=optimizer,
                             config=fxshard.Config(nonfinite="skip"))
    assert len(guards(skipping.program)) == 1  # one flag, every update reads it (the dump shows it)
    reference = fxshard.shard(model, regression_loss, good[0], optimizer=optimizer)
    flags = [bool(skipping(batch)["skipped"]) for batch in (good[0], poisoned(good[1]), good[1], good[2])]
    for batch in good:
        assert not bool(reference(batch)["skipped"])
    assert flags == [False, True, False, False] and skipping.skipped_steps == 1
    expected, got = reference.parameters(), skipping.parameters()
    for name, value in expected.items():
        assert torch.equal(got[name], value), name
    for name, value in reference.optimizer_state().items():
        assert torch.equal(skipping.optimizer_state()[name], value), name
    assert "3 buffers kept on skipped steps" in skipping.lowerings()
    for name, value in reference.buffers().items():
        assert torch.equal(skipping.buffers()[name], value), name
    ignoring = fxshard.shard(model, regression_loss, good[0], optimizer=optimizer,
                             config=fxshard.Config(nonfinite="ignore"))
    assert not guards(ignoring.program)
    ignoring(poisoned(good[0]))
    assert not all(torch.isfinite(p).all() for p in ignoring.parameters().values())  # what the guard prevents


def test_raise_names_the_step_and_the_first_parameter_and_keeps_the_last_good_state(tmp_path):
    torch.manual_seed(0)
    model = Regressor()
    good = regression_batches(3)
    step = fxshard.shard(model, regression_loss, good[0], optimizer=ADAMW)  # "raise" is the default
    step(good[0])
    before = {name: value.clone() for name, value in step.parameters().items()}
    step(poisoned(good[1]))  # read when the state is next read
    with pytest.raises(fxshard.FxShardError) as caught:
        step.parameters()
    message = str(caught.value)
    assert message.startswith("step 2: the gradients are not finite (grad norm nan); the first parameter whose "
                              "gradient is not finite is layers.0.weight (on rank 0)"), message
    assert "parameters, optimizer state and updated buffers are those after step 1." in message and "nonfinite='skip'" in message
    for name, value in step.parameters().items():  # reported once; the bad update was never applied
        assert torch.equal(value, before[name]), name
    step(poisoned(good[1]))  # step 3: a call checks the step before the last, so the host runs ahead
    step(good[1])
    with pytest.raises(fxshard.FxShardError) as caught:
        step(good[2])
    assert str(caught.value).startswith("step 3: the gradients are not finite") and \
        "are those after step 4 (step 4 ran before this check; metrics['skipped'] says which" in str(caught.value)
    step(poisoned(good[1]))  # a save reports it too, before writing: the run's last step may be the bad one
    with pytest.raises(fxshard.FxShardError, match="step 5: the gradients are not finite"):
        fxshard.save(step, tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()


def scaled_loss(model, batch):
    """The model's loss times a per-row weight: a NaN weight on one rank poisons every gradient."""
    return model.loss({"idx": batch["idx"], "tgt": batch["tgt"]}) * batch["scale"].mean()


def token_batch(rows, seq, vocab, seed, scale=1.0):
    generator = torch.Generator().manual_seed(seed)
    return {"idx": torch.randint(0, vocab, (rows, seq), generator=generator),
            "tgt": torch.randint(0, vocab, (rows, seq), generator=generator),
            "scale": torch.full((rows,), scale)}


@given(layout=st.sampled_from(["dp2-zero1", "dp2-zero3", "dp2xep2", "pp2xdp2"]), bad_rank=st.integers(0, 3),
       use_sgd=st.booleans())
def test_every_rank_skips_a_step_whose_gradients_one_rank_poisoned(layout, bad_rank, use_sgd):
    """SPMD simulator: one rank's NaN makes every rank skip the step, and every rank ends where a run
    without that step ends, bit for bit."""
    torch.manual_seed(0)
    vocab, microbatches = 16, 2
    if layout == "dp2xep2":
        model = MoEGPT(MoEGPTConfig(vocab_size=vocab, d_model=8, n_layer=2, n_head=2, n_expert=4, top_k=2, d_ff_expert=8))
        mesh = fxshard.Mesh(dp=2, ep=2)
    else:
        model = GPT(GPTConfig(vocab_size=vocab, d_model=8, n_layer=2, n_head=2, d_ff=12))
        mesh = fxshard.Mesh(pp=2, dp=2) if layout == "pp2xdp2" else fxshard.Mesh(dp=2)
    bad_rank %= mesh.size
    optimizer = fxshard.optim.SGD(lr=0.1, momentum=0.9) if use_sgd else ADAMW
    config = fxshard.Config(nonfinite="skip", sharding="optim" if layout == "dp2-zero1" else "optim_grads_params",
                            microbatches=microbatches if mesh.pp > 1 else 1)
    rows = 2 * microbatches
    batches = [[token_batch(rows, 4, vocab, seed=10 * step + mesh.coords(rank)["dp"]) for rank in range(mesh.size)]
               for step in range(3)]
    example = {key: value[:rows // config.microbatches] for key, value in batches[0][0].items()}
    program = fxshard.trace(model, scaled_loss, example, optimizer=optimizer,
                            config=fxshard.Config(nonfinite="skip"))
    stages = [run_pipeline(program, mesh, config, stage=stage)[-1] for stage in range(mesh.pp)]
    skipping, reference = SimulatedRanks(stages, model, optimizer, mesh), SimulatedRanks(stages, model, optimizer, mesh)
    # the ranks of a pipeline read one batch (the last stage its loss weights): poison it on all of them
    poisoned_dp = mesh.coords(bad_rank)["dp"] if mesh.pp > 1 else None
    bad = [dict(batch, scale=torch.full((rows,), float("nan")) if rank == bad_rank or
                mesh.coords(rank)["dp"] == poisoned_dp else batch["scale"]) for rank, batch in enumerate(batches[1])]
    skipping.step(batches[0])
    assert all(not torch.isfinite(metrics["grad_norm"]) for metrics in skipping.step(bad))
    skipping.step(batches[2])
    for local in (batches[0], batches[2]):
        reference.step(local)
    assert skipping.skipped == 1
    expected = reference.parameters(mesh.size - 1)
    for name, value in skipping.parameters(mesh.size - 1).items():
        assert torch.equal(value, expected[name]), name


class Shifted(Regressor):
    """A Regressor whose input shift ("pre") gets the batch's weights `w` as an extra gradient: an inf
    in `w` on one rank makes that gradient, and no other, not finite there."""

    def __init__(self):
        super().__init__()
        self.shift = nn.Parameter(torch.zeros(8))

    def forward(self, x):
        return super().forward(x + self.shift)


def shifted_loss(model, batch):
    return regression_loss(model, batch) + (model.shift * batch["w"]).sum()


def test_a_gradient_reduced_under_the_updates_that_is_not_finite_on_one_rank_skips_every_rank():
    """ZeRO-3 reduces the last units' gradients ("pre" here) in the optimizer phase, under the
    other units' updates (passes/fsdp.py deferred_units): the skip is decided from the unreduced
    gradients, and one rank's inf there still skips the step on both."""
    from fxshard.passes.fsdp import FSDPConfig, fsdp

    torch.manual_seed(0)
    model, mesh = Shifted(), fxshard.Mesh(dp=2)
    batches = [[dict(batch, w=torch.ones(8)) for batch in regression_batches(2, seed=step)] for step in range(3)]
    config = fxshard.Config(nonfinite="skip")
    program = fsdp(fxshard.trace(model, shifted_loss, batches[0][0], optimizer=ADAMW, config=config),
                   FSDPConfig(2, "optim_grads_params"))
    deferred = [n.meta["fxshard_unit"] for n in program.graph.nodes
                if n.target is torch.ops._c10d_functional.reduce_scatter_tensor.default and n.meta["fxshard_phase"] == "optim"]
    assert "pre" in deferred
    skipping, reference = (SimulatedRanks(program, model, ADAMW, mesh) for _ in range(2))
    inf_first = torch.ones(8)
    inf_first[0] = float("inf")  # rank 1's gradient; reduced, it lands in rank 0's shard of "pre"
    bad = [batches[1][0], dict(batches[1][1], w=inf_first)]
    skipping.step(batches[0])
    metrics = skipping.step(bad)
    assert all(bool(m["nonfinite"][0]) for m in metrics)  # skipped, on both ranks
    assert [bool(m["nonfinite"][1:].any()) for m in metrics] == [True, False]
    skipping.step(batches[2])
    for local in (batches[0], batches[2]):
        reference.step(local)
    assert skipping.skipped == 1
    for rank in range(2):
        expected = reference.parameters(rank)
        for name, value in skipping.parameters(rank).items():
            assert torch.equal(value, expected[name]), (name, rank)


@pytest.mark.filterwarnings("ignore:fxshard. Config.param_dtype / reduce_dtype=torch.float16, loss_scale=False")
def test_gradients_reduced_in_fp16_are_checked_after_the_reduction_whose_sum_can_overflow():
    """An fp16 mean over the ranks sums first: 4e4 on each of two ranks is finite there, 8e4 is not
    (fp16's largest is 65504). The skip is then decided from the reduced gradients (none deferred),
    so the step that reduced to inf is skipped instead of applied."""
    from fxshard.passes.fsdp import FSDPConfig, fsdp

    torch.manual_seed(0)
    model, mesh = Shifted(), fxshard.Mesh(dp=2)
    batches = [[dict(batch, w=torch.ones(8)) for batch in regression_batches(2, seed=step)] for step in range(2)]
    config = fxshard.Config(nonfinite="skip", reduce_dtype=torch.float16, loss_scale=False)  # the sum's own overflow
    program = fsdp(fxshard.trace(model, shifted_loss, batches[0][0], optimizer=ADAMW, config=config),
                   FSDPConfig(2, "optim_grads_params"))
    def deferred(program):
        return [n.meta["fxshard_unit"] for n in program.graph.nodes if n.meta.get("fxshard_phase") == "optim"
                and n.target is torch.ops._c10d_functional.reduce_scatter_tensor.default]
    assert not deferred(program)
    for wide in (torch.float32, torch.bfloat16):  # their range is float32's: "pre" deferred (test above)
        config_wide = fxshard.Config(nonfinite="skip", reduce_dtype=wide)
        assert "pre" in deferred(fsdp(fxshard.trace(model, shifted_loss, batches[0][0], optimizer=ADAMW,
                                                    config=config_wide), FSDPConfig(2, "optim_grads_params")))
    ranks = SimulatedRanks(program, model, ADAMW, mesh)
    before = ranks.parameters(0)
    large = torch.ones(8)
    large[0] = 4e4 * 2  # the loss tangent halves it: 4e4 on each rank
    metrics = ranks.step([dict(batch, w=large) for batch in batches[1]])
    assert not torch.isfinite(metrics[0]["grad_norm"]) and ranks.skipped == 1
    for rank in range(2):
        assert all(torch.equal(value, before[name]) for name, value in ranks.parameters(rank).items())


@pytest.mark.parametrize("poisoned_param", ["shift", "head.bias"])
def test_raise_names_the_one_parameter_whose_gradient_is_not_finite(poisoned_param):
    torch.manual_seed(0)
    good = [dict(batch, w=torch.ones(8)) for batch in regression_batches(2)]

    def loss(model, batch):  # batch["w"] is the named parameter's extra gradient
        extra = model.shift * batch["w"] if poisoned_param == "shift" else model.head.bias * batch["w"][:1]
        return regression_loss(model, batch) + extra.sum()

    step = fxshard.shard(Shifted(), loss, good[0], optimizer=ADAMW)
    step(dict(good[0], w=torch.full((8,), float("inf"))))
    with pytest.raises(fxshard.FxShardError) as caught:
        step.parameters()
    assert f"the first parameter whose gradient is not finite is {poisoned_param} (on rank 0)" in str(caught.value)


def test_a_bound_that_overflows_where_the_reduced_norm_does_not_skips_and_says_so():
    """The corner Deferred documents: huge gradients of opposite sign on the two ranks cancel in the
    mean (finite gradient norm), but their squares overflow the bound the skip is decided from."""
    import types

    from fxshard.passes.fsdp import FSDPConfig, fsdp
    from fxshard.runtime.nonfinite import nonfinite_error

    torch.manual_seed(0)
    model, mesh = Shifted(), fxshard.Mesh(dp=2)
    batches = [[dict(batch, w=torch.ones(8)) for batch in regression_batches(2, seed=step)] for step in range(2)]
    program = fsdp(fxshard.trace(model, shifted_loss, batches[0][0], optimizer=ADAMW,
                                 config=fxshard.Config(nonfinite="skip")), FSDPConfig(2, "optim_grads_params"))
    ranks = SimulatedRanks(program, model, ADAMW, mesh)
    huge = [torch.ones(8), torch.ones(8)]
    huge[0][0], huge[1][0] = 1.5e19, -1.5e19
    before = ranks.parameters(0)
    metrics = ranks.step([dict(batch, w=w) for batch, w in zip(batches[1], huge)])
    assert torch.isfinite(metrics[0]["grad_norm"]) and ranks.skipped == 1
    assert all(torch.equal(value, before[name]) for name, value in ranks.parameters(0).items())
    view = types.SimpleNamespace(program=ranks.program, programs=ranks.programs, rank=0)
    message = str(nonfinite_error(view, 1, 1, float(metrics[0]["grad_norm"]), metrics[0]["nonfinite"]))
    assert message.startswith("step 1: the gradients are too large to check (grad norm ") and \
        "overflow float32" in message, message


def test_a_step_stopped_mid_update_refuses_to_go_on_until_a_checkpoint_is_loaded(tmp_path):
    """AdamW writes its updates in place one tensor after another: a step stopped among them (Ctrl-C,
    out of memory) leaves some stepped and others not. Training on, or saving, is refused; loading
    the last checkpoint clears it and training resumes exactly."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class StopAtSecondUpdate(TorchDispatchMode):
        seen = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.fxshard.adamw_update.default, torch.ops.fxshard.adamw_update_.default):
                self.seen += 1
                if self.seen == 2:
                    raise self.error("stopped in the optimizer phase")
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    data = regression_batches(3)
    # the updates go through the dispatcher, where the mode stops the second one (eager replay calls
    # fxshard's ops as their bodies otherwise: runtime/direct_calls.py)
    step = fxshard.shard(Regressor(), regression_loss, data[0], optimizer=ADAMW,
                         config=fxshard.Config(direct_calls=False))
    step(data[0])
    fxshard.save(step, tmp_path / "ck")
    for error in (RuntimeError, KeyboardInterrupt):  # an op's error after the first update, or Ctrl-C
        StopAtSecondUpdate.error, StopAtSecondUpdate.seen = error, 0
        with pytest.raises(error), StopAtSecondUpdate():
            step(data[1])
        for use in (lambda: step(data[1]), step.parameters, step.buffers, lambda: fxshard.save(step, tmp_path / "other"),
                    lambda: step.evaluate(data[1])):
            with pytest.raises(fxshard.FxShardError, match=rf"step 2 stopped while it ran \({error.__name__}: stopped "
                                                            r"in the optimizer phase\).*load the last checkpoint"):
                use()
        fxshard.load(step, tmp_path / "ck")
    torch.manual_seed(0)
    fresh = fxshard.shard(Regressor(), regression_loss, data[0], optimizer=ADAMW)
    fresh(data[0])  # where the checkpoint was taken
    for batch in data[1:]:
        assert torch.equal(step(batch)["loss"], fresh(batch)["loss"])
    assert all(torch.equal(step.parameters()[n], p) for n, p in fresh.parameters().items())


def test_local_state_reads_do_not_report_a_pending_non_finite_step_and_lr_must_fit_float32():
    """buffers() and optimizer_state() read this rank alone (reporting a non-finite step gathers from
    every rank: one rank logging its state alone would wait for the others); the next step reports."""
    torch.manual_seed(0)
    good = regression_batches(3)
    step = fxshard.shard(Regressor(), regression_loss, good[0], optimizer=ADAMW)
    step(poisoned(good[0]))
    assert step.optimizer_state() and isinstance(step.buffers(), dict)
    with pytest.raises(fxshard.FxShardError, match="step 1: the gradients are not finite"):
        step.parameters()
    for bad in (1e39, True, float("nan")):
        with pytest.raises(fxshard.FxShardError, match="set_lr needs a finite float >= 0"):
            step.set_lr(bad)
    step.set_lr(0.5)
    assert step.lr == 0.5
    step.set_lr(None)  # back to the optimizer's
    assert step.lr == ADAMW.lr
