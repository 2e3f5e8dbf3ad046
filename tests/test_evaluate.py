"""step.evaluate(batch): the loss in eval mode (dropout off) under the current parameters, nothing
updated, under every mesh; against eager PyTorch's model.eval() loss."""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from hypothesis import given, strategies as st

import fxshard
from fxshard import meta
from fxshard.launch import run_local
from fxshard.models import GPT, GPTConfig, MoEGPT, MoEGPTConfig
from fxshard.passes import run_pipeline
from fxshard.runtime.evaluate import EvalMode, forward_only
from fxshard.testing import SimulatedRanks, relative
from test_nonfinite import ADAMW, regression_batches, regression_loss


class DropoutRegressor(nn.Module):
    def __init__(self, width=8, depth=2, p=0.5):
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Dropout(p))
                                    for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def eager_eval_loss(model, parameters, loss_fn, pieces) -> float:
    """The eager loss in eval mode with `parameters`: the mean over the batch pieces, as a step's loss is."""
    reference = copy.deepcopy(model)
    reference.load_state_dict(parameters, strict=False)
    reference.eval()
    with torch.no_grad():
        return (sum(loss_fn(reference, piece) for piece in pieces) / len(pieces)).item()


def test_evaluate_is_eager_eval_mode_and_changes_nothing():
    torch.manual_seed(0)
    model = DropoutRegressor()
    batches = regression_batches(3)
    step = fxshard.shard(model, regression_loss, batches[0], optimizer=ADAMW)
    twin = fxshard.shard(model, regression_loss, batches[0], optimizer=ADAMW)
    torch.manual_seed(1)
    step(batches[0])
    torch.manual_seed(1)
    twin(batches[0])
    first = step.evaluate(batches[1])["loss"]
    assert torch.equal(first, step.evaluate(batches[1])["loss"])  # no dropout: the same twice
    want = eager_eval_loss(model, step.parameters(), regression_loss, [batches[1]])
    assert abs(first.item() - want) <= 1e-6 * abs(want), (first.item(), want)
    training = step.program.outputs[0]
    assert training.name == "loss" and step.step_count == 1
    torch.manual_seed(2)
    step(batches[2])  # training goes on as if evaluate had not run (same dropout draws, same update)
    torch.manual_seed(2)
    twin(batches[2])
    for name, value in twin.parameters().items():
        assert torch.equal(step.parameters()[name], value), name


def test_evaluate_after_the_last_step_of_an_lr_schedule_does_not_ask_it_for_another_and_state_reads_are_copies():
    schedule = fxshard.optim.AdamW(lr=lambda step: [1e-2, 5e-3][step - 1])  # defined for two steps
    torch.manual_seed(0)
    batches = regression_batches(2)
    step = fxshard.shard(DropoutRegressor(), regression_loss, batches[0], optimizer=schedule)
    step(batches[0])
    held = step.optimizer_state()  # copies: the next step leaves them as they were
    frozen = {name: value.clone() for name, value in held.items()}
    step(batches[1])
    assert held and all(torch.equal(held[name], frozen[name]) for name in held)
    assert sorted(held) == sorted(f"{slot}/{name}" for name, p in DropoutRegressor().named_parameters()
                                  for slot in ("exp_avg", "exp_avg_sq"))  # as optimizer_state() documents
    assert any(not torch.equal(step.optimizer_state()[name], frozen[name]) for name in held)
    assert torch.isfinite(step.evaluate(batches[0])["loss"])
    with pytest.raises(IndexError):
        step(batches[0])  # training does ask it: a schedule's own error, as torch's LambdaLR would raise


def test_the_step_keeps_neither_the_model_nor_its_weights_alive_and_still_evaluates():
    import gc
    import weakref

    torch.manual_seed(0)
    model = DropoutRegressor()
    batch = regression_batches(1)[0]
    step = fxshard.shard(model, regression_loss, batch, optimizer=ADAMW)
    weight, whole = weakref.ref(model.head.weight), weakref.ref(model)
    del model
    gc.collect()
    assert weight() is None and whole() is None
    step(batch)
    reference = DropoutRegressor()
    reference.load_state_dict(step.parameters())
    reference.eval()
    with torch.no_grad():
        want = regression_loss(reference, batch).item()
    assert abs(step.evaluate(batch)["loss"].item() - want) <= 1e-6 * abs(want)


def test_evaluate_reports_the_metrics_of_a_moe_model():
    torch.manual_seed(0)
    model = MoEGPT(MoEGPTConfig.preset("tiny"))
    generator = torch.Generator().manual_seed(0)
    batch = {"idx": torch.randint(0, 64, (4, 16), generator=generator),
             "tgt": torch.randint(0, 64, (4, 16), generator=generator)}
    step = fxshard.shard(model, lambda m, b: m.loss_and_metrics(b), batch, optimizer=ADAMW)
    step(batch)
    metrics = step.evaluate(batch)
    training_metrics = {spec.name for spec in step.program.outputs if spec.kind.value == "metric"}
    assert set(metrics) == {"loss", *training_metrics}
    want = eager_eval_loss(model, step.parameters(), lambda m, b: m.loss_and_metrics(b)[0], [batch])
    assert abs(metrics["loss"].item() - want) <= 1e-6 * abs(want)


def token_batch(rows, seq, vocab, seed):
    generator = torch.Generator().manual_seed(seed)
    return {"idx": torch.randint(0, vocab, (rows, seq), generator=generator),
            "tgt": torch.randint(0, vocab, (rows, seq), generator=generator)}


@given(layout=st.sampled_from(["dp2-zero3", "dp2xep2", "pp2xdp2", "pp2-interleaved"]))
def test_evaluation_programs_compute_the_eager_eval_loss_on_every_mesh(layout):
    """SPMD simulator: forward_only of each rank's eval-mode program gives eager's eval loss on the
    global batch, and keeps nothing of the backward or the optimizer."""
    torch.manual_seed(0)
    vocab = 16
    if layout == "dp2xep2":
        model = MoEGPT(MoEGPTConfig(vocab_size=vocab, d_model=8, n_layer=2, n_head=2, n_expert=4, top_k=2, d_ff_expert=8))
        mesh = fxshard.Mesh(dp=2, ep=2)
    else:
        model = GPT(GPTConfig(vocab_size=vocab, d_model=8, n_layer=4, n_head=2, d_ff=12))
        mesh = {"dp2-zero3": fxshard.Mesh(dp=2), "pp2xdp2": fxshard.Mesh(pp=2, dp=2)}.get(layout, fxshard.Mesh(pp=2))
    config = fxshard.Config(microbatches=2 if mesh.pp > 1 else 1, virtual_stages=2 if layout == "pp2-interleaved" else 1)
    local = [token_batch(4, 4, vocab, seed=dp) for dp in range(mesh.dp)]
    with EvalMode(model):
        traced = fxshard.trace(model, lambda m, b: m.loss(b), {k: v[:4 // config.microbatches] for k, v in local[0].items()}
                               if mesh.pp > 1 else local[0], optimizer=ADAMW)
        stages = [forward_only(run_pipeline(traced, mesh, config, stage=stage)[-1]) for stage in range(mesh.pp)]
    assert model.training  # EvalMode gave the model its mode back
    for program in stages:
        sends = {n for n in program.graph.nodes if n.target is torch.ops.fxshard.send.default}
        assert not [n for n in program.graph.nodes if n.target is torch.ops.fxshard.adamw_update.default or
                    (meta.phase(n) == meta.BWD and not set(n.all_input_nodes) <= sends)]  # a send's wait may stay
        assert [spec.kind.value for spec in program.outputs] == ["loss"] + ["metric"] * (len(program.outputs) - 1)
    ranks = SimulatedRanks(stages, model, ADAMW, mesh)
    metrics = ranks.step([local[mesh.coords(rank)["dp"]] for rank in range(mesh.size)])
    rows = 4 // config.microbatches  # a step's loss: the mean over ranks and microbatches
    pieces = [{k: v[i * rows:(i + 1) * rows] for k, v in batch.items()} for batch in local
              for i in range(config.microbatches)]
    want = eager_eval_loss(model, dict(model.named_parameters()), lambda m, b: m.loss(b), pieces)
    for rank_metrics in metrics:
        assert relative(rank_metrics["loss"], torch.tensor(want)) <= 1e-6, (rank_metrics["loss"], want)


def evaluate_zero3():
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DropoutRegressor()
    batches = [regression_batches(2, seed=r) for r in range(2)]
    step = fxshard.shard(model, regression_loss, batches[rank][0], optimizer=ADAMW, mesh=fxshard.Mesh(dp=2))
    step(batches[rank][0])
    loss = step.evaluate(batches[rank][1])["loss"].item()
    want = eager_eval_loss(model, step.parameters(), regression_loss, [b[1] for b in batches])
    evaluation, _ = step._evaluation  # what the first evaluate() compiled
    return loss, want, evaluation.notes.get("trace_shared_by")


def test_evaluate_under_zero3_on_real_processes():
    """On gloo the evaluation's trace is shared as the step's is: rank 1 loads rank 0's."""
    results = run_local(evaluate_zero3, 2, backend="gloo")
    for loss, want, _ in results:
        assert abs(loss - want) <= 1e-6 * abs(want), (loss, want)
    assert [shared_by for *_, shared_by in results] == [None, 0]


def test_switching_the_model_to_eval_after_shard_warns_once_and_changes_nothing():
    import warnings

    import pytest

    torch.manual_seed(0)
    model = DropoutRegressor()
    batch = regression_batches(1)[0]
    step = fxshard.shard(model, regression_loss, batch, optimizer=ADAMW)
    model.eval()
    with pytest.warns(UserWarning, match=r"switched to eval mode after shard\(\); the compiled step keeps the mode "
                                         r"it was traced in \(train\). Use step.evaluate"):
        step(batch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step(batch)  # said once
    assert not model.training  # the user's model keeps the mode they gave it
    # the other way round (transformers' from_pretrained returns an eval-mode model): said at shard, and
    # again, with the fix for this direction, when the model is switched to train mode after it
    with pytest.warns(UserWarning, match=r"the model is in eval mode .* 2 dropout / BatchNorm modules \(layers.0.2, \.\.\.\)"
                                         r".*Call model.train\(\) before shard\(\)"):
        step = fxshard.shard(model, regression_loss, batch, optimizer=ADAMW)
    model.train()
    with pytest.warns(UserWarning, match=r"switched to train mode after shard\(\).*\(eval\). To train in train mode "
                                         r"\(dropout on\), call model.train\(\) before shard\(\)"):
        step(batch)


def test_a_model_that_cannot_be_copied_is_kept_for_evaluate_with_a_warning():
    import threading

    model = torch.nn.Linear(4, 1)
    model.lock = threading.Lock()  # cannot be deep-copied
    with pytest.warns(UserWarning, match="cannot be deep-copied .* evaluate\\(\\) computes the changed model"):
        step = fxshard.shard(model, lambda m, b: m(b).pow(2).mean(), torch.randn(2, 4))
    assert torch.isfinite(step.evaluate(torch.randn(2, 4))["loss"])
