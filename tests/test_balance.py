"""torchtitan's auxiliary-loss-free MoE load balancing, traced into the step (fxshard/balance.py):
the routing bias and the token counts after each step are those torchtitan's optimizer hook leaves,
on one device and over data- and expert-parallel ranks (the counts summed over the ranks)."""

import copy

import pytest
import torch

import fxshard
from fxshard import program_io
from fxshard.api import _compile
from fxshard.program import InputKind
from fxshard.testing import SimulatedRanks, relative, torch_optimizer
from model_zoo import titan_deepseek_v3, titan_loss, torchtitan_balancing_hook

ADAMW = fxshard.optim.AdamW(lr=1e-2)
COEFF = 0.05  # large enough that the bias moves the routing within the test's steps
ROWS, SEQ, STEPS = 4, 8, 3


def balanced_model():
    torch.manual_seed(0)
    return titan_deepseek_v3(layers=3, load_balance_coeff=COEFF)


def data(seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(0, 64, (ROWS, SEQ), generator=generator),
             "labels": torch.randint(0, 64, (ROWS, SEQ), generator=generator)} for _ in range(STEPS)]


def moe_layers(model):
    return [m for m in model.modules() if getattr(m, "load_balance_coeff", None) is not None]


def eager(model, batches, pieces):
    """torchtitan's training loop: the loss (mean over `pieces` equal parts of the global batch),
    backward, its pre-step hook (components/optimizer/optimizer.py, `_update_expert_bias`), the step.
    Returns the losses."""
    optimizer = torch_optimizer(ADAMW, model.parameters())
    losses = []
    for batch in batches:
        optimizer.zero_grad()
        rows = ROWS // pieces
        loss = sum(titan_loss(model, {k: v[i * rows:(i + 1) * rows] for k, v in batch.items()})
                   for i in range(pieces)) / pieces
        loss.backward()
        torchtitan_balancing_hook(model)
        optimizer.step()
        losses.append(loss.item())
    return losses


def test_one_device_with_microbatches_balances_like_torchtitans_hook():
    model, batches = balanced_model(), data()
    reference = copy.deepcopy(model)
    want = eager(reference, batches, pieces=2)
    step = fxshard.shard(model, titan_loss, batches[0], optimizer=ADAMW, config=fxshard.Config(microbatches=2))
    got = [step(batch)["loss"].item() for batch in batches]
    assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(got, want)), (got, want)
    buffers = step.buffers()
    for name, value in reference.named_buffers():
        if name.endswith("expert_bias_E"):
            assert value.abs().sum() > 0, name  # the hook moved it: the test sees balancing at work
        assert torch.allclose(buffers[name], value, atol=1e-6), name  # counts: zero after the step
    assert [line.split(":")[0] for line in step.program.notes["load_balancing"]] == ["layers.1.moe", "layers.2.moe"]


def test_the_counts_are_summed_over_the_data_ranks_before_the_update():
    """Two simulated ranks (dp=2 x ep=2: the experts split too), each on its half of the global batch:
    every rank's bias is the one torchtitan's hook computes from the whole batch's counts (not from
    its own half's)."""
    mesh = fxshard.Mesh(dp=2, ep=2)
    model, batches = balanced_model(), data(seed=1)
    half = ROWS // 2
    assert _halves_would_update_otherwise(model, batches[0], half)  # so the test sees the sum
    reference = copy.deepcopy(model)
    want = eager(reference, batches, pieces=2)
    program = _compile(model, titan_loss, {k: v[:half] for k, v in batches[0].items()}, ADAMW, mesh,
                       fxshard.Config(sharding="optim_grads_params"))[-1]
    summed = [n for n in program.graph.nodes if n.target is torch.ops._c10d_functional.all_reduce.default
              and n.args[1:] == ("sum", "dp") and tuple(n.meta["val"].shape) == (2, 4)]
    assert len(summed) == 1  # both layers' counts, in one all-reduce
    assert program_io.loads(program_io.dumps(program)).balances == program.balances  # a shared trace keeps them
    ranks = SimulatedRanks(program, model, ADAMW, mesh)
    for batch, loss in zip(batches, want):
        metrics = ranks.step([{k: v[r * half:(r + 1) * half] for k, v in batch.items()} for r in range(2)])
        assert abs(metrics[0]["loss"].item() - loss) <= 1e-5 * abs(loss)
    params = ranks.parameters()
    assert max(relative(params[n], p) for n, p in reference.named_parameters()) < 1e-4
    for name, value in reference.named_buffers():
        for rank in range(2):
            assert torch.allclose(ranks.states[rank][InputKind.BUFFER, name], value, atol=1e-6), (name, rank)


def _halves_would_update_otherwise(model, batch, half) -> bool:
    """Whether a rank's own counts (its half of `batch`) give another update than the whole batch's."""
    model, per_half = copy.deepcopy(model), []
    for r in range(2):
        for moe in moe_layers(model):
            moe.tokens_per_expert_E.zero_()
        with torch.no_grad():
            titan_loss(model, {k: v[r * half:(r + 1) * half] for k, v in batch.items()})
        per_half.append([moe.tokens_per_expert_E.clone() for moe in moe_layers(model)])

    def direction(counts):
        return torch.sign(counts.mean() - counts)
    return any(not torch.equal(direction(mine[layer]), direction(per_half[0][layer] + per_half[1][layer]))
               for mine in per_half for layer in range(len(mine)))


def test_pipeline_stages_balance_their_own_layers_once_a_step():
    """Each stage updates the layers it holds after its last microbatch's forward (the traced program
    of one microbatch does not), its counts summed over its dp ranks: the stage holding a layer has
    torchtitan's bias for it (pp=2 x dp=2, zero-bubble schedule)."""
    mesh, schedule = fxshard.Mesh(pp=2, dp=2), "zb-h1"
    model, batches = balanced_model(), data(seed=1)
    dp = mesh.dp
    reference = copy.deepcopy(model)
    want = eager(reference, batches, pieces=2 * dp)
    rows = ROWS // dp
    config = fxshard.Config(microbatches=2, schedule=schedule, sharding="optim_grads_params")
    stages = [_compile(model, titan_loss, {k: v[:rows] for k, v in batches[0].items()}, ADAMW, mesh, config,
                       (stage,))[-1] for stage in range(mesh.pp)]
    ranks = SimulatedRanks(stages, model, ADAMW, mesh)
    for batch, loss in zip(batches, want):
        metrics = ranks.step([{k: v[mesh.coords(r)["dp"] * rows:][:rows] for k, v in batch.items()}
                              for r in range(mesh.size)])
        assert abs(metrics[0]["loss"].item() - loss) <= 1e-5 * abs(loss)
    held = []
    for name, value in reference.named_buffers():
        for rank in range(mesh.size):
            if name.endswith(("expert_bias_E", "tokens_per_expert_E")) and (InputKind.BUFFER, name) in ranks.states[rank]:
                held.append(mesh.coords(rank)["pp"])
                assert torch.allclose(ranks.states[rank][InputKind.BUFFER, name], value, atol=1e-6), (name, rank)
    assert sorted(held) == [0] * 2 * dp + [1] * 2 * dp, held  # a layer on each stage, each on its dp ranks


def test_the_layers_are_found_by_their_buffers_and_unusual_ones_are_refused_or_said():
    """A coefficient of any real type counts (torchtitan multiplies by it); two layers sharing a buffer
    are refused; a layer with a coefficient and a bias but no counts is said to stay unbalanced; a bf16
    bias is updated in fp32 and rounded once, as torchtitan's add_ does."""
    from fxshard.balance import balanced_layers, balancing_update

    model = balanced_model()
    moes = moe_layers(model)
    moes[0].load_balance_coeff = torch.tensor(COEFF)
    assert [(b.layer, b.coeff) for b in balanced_layers(model)] == [("layers.1.moe", pytest.approx(COEFF)),
                                                                     ("layers.2.moe", COEFF)]
    moes[1].tokens_per_expert_E = moes[0].tokens_per_expert_E
    with pytest.raises(fxshard.FxShardError, match="share one load-balancing counts buffer"):
        balanced_layers(model)
    del moes[1]._buffers["tokens_per_expert_E"]
    with pytest.warns(UserWarning, match=r"1 module\(s\) \(layers.2.moe\) have load_balance_coeff and a routing "
                                         r"bias but no token-count buffer"):
        assert [b.layer for b in balanced_layers(model)] == ["layers.1.moe"]
    generator = torch.Generator().manual_seed(0)  # 4096 experts: some entries round otherwise if rounded twice
    bias = (torch.randn(4096, generator=generator) * 0.05).to(torch.bfloat16)
    counts = torch.randint(0, 100, (4096,), generator=generator).float()
    new_bias, new_counts = balancing_update([1e-3], [counts], [bias])
    delta = 1e-3 * torch.sign(counts.mean() - counts)
    assert torch.equal(new_bias, (bias.float() + delta - delta.mean()).to(torch.bfloat16)) and not new_counts.any()


def test_a_program_with_its_balancing_is_refused_by_the_stage_split():
    from fxshard.passes.pipeline import split_stages

    model, batches = balanced_model(), data()
    with pytest.raises(fxshard.FxShardError, match=r"balance=False"):
        split_stages(fxshard.trace(model, titan_loss, batches[0]), 2)
    # traced with balance=False (as shard does under Mesh(pp>1)) it splits: the pipeline test above
