"""Mixed precision: bf16 compute on fp32 masters, single-device and under ZeRO-3 (cast before gather)."""

import copy
import math

import pytest
import torch

import fxshard
from fxshard import meta
from fxshard.models import GPT, GPTConfig
from fxshard.passes.fsdp import FSDPConfig, fsdp
from fxshard.testing import SimulatedRanks, relative, torch_optimizer
from test_nonfinite import Regressor, regression_batches, regression_loss

ADAMW = fxshard.optim.AdamW(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
MIXED = fxshard.Config(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
c10d = torch.ops._c10d_functional


def batches(count, rows=4, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [{"idx": torch.randint(0, 64, (rows, 16), generator=generator),
             "tgt": torch.randint(0, 64, (rows, 16), generator=generator)} for _ in range(count)]


def loss_fn(model, batch):
    return model.loss(batch)


def test_bf16_compute_matches_eager_bf16_copy_with_fp32_masters():
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny"))
    master, low = copy.deepcopy(model), copy.deepcopy(model).to(torch.bfloat16)
    optimizer = torch_optimizer(ADAMW, master.parameters())
    step = fxshard.shard(model, loss_fn, batches(1)[0], optimizer=ADAMW, config=MIXED)
    assert all(v.dtype == torch.float32 for v in step.parameters().values())
    for index, batch in enumerate(batches(10)):
        with torch.no_grad():
            for p16, p in zip(low.parameters(), master.parameters()):
                p16.copy_(p)
        low.zero_grad()
        eager = low.loss(batch)
        eager.backward()
        for p16, p in zip(low.parameters(), master.parameters()):
            p.grad = p16.grad.float()
        optimizer.step()
        ours = step(batch)["loss"].item()
        # identical kernels: the first steps agree exactly; bf16 rounding then amplifies through Adam
        tolerance = 0.0 if index == 0 else 1e-3
        assert abs(ours - eager.item()) <= tolerance * abs(eager.item()), (index, ours, eager.item())


def test_zero3_casts_the_shard_before_the_all_gather_and_reduces_in_fp32():
    torch.manual_seed(0)
    world = 2
    model = GPT(GPTConfig.preset("tiny"))
    data = batches(4, rows=2 * world)
    sgd = fxshard.optim.SGD(lr=0.05, momentum=0.9)  # updates proportional to gradients: comparable in bf16
    local = fxshard.trace(model, loss_fn, {k: v[:2] for k, v in data[0].items()}, optimizer=sgd, config=MIXED)
    program = fsdp(local, FSDPConfig(world))
    gathers = [n for n in program.graph.nodes if n.target is c10d.all_gather_into_tensor.default]
    for gather in gathers:
        cast = gather.args[0]
        assert cast.target is torch.ops.aten._to_copy.default and cast.args[0].op == "placeholder"
        assert gather.meta["val"].dtype == torch.bfloat16
        assert gather.meta[meta.COMM_BYTES] == cast.meta["val"].numel() * 2
    scatters = [n for n in program.graph.nodes if n.target is c10d.reduce_scatter_tensor.default]
    assert scatters and all(s.meta["val"].dtype == torch.float32 for s in scatters)

    single = fxshard.shard(copy.deepcopy(model), loss_fn, data[0], optimizer=sgd, config=MIXED)
    ranks = SimulatedRanks(program, model, sgd, fxshard.Mesh(dp=world))
    for batch in data:
        expected = single(batch)["loss"]
        losses = ranks.step([{k: v[r * 2:(r + 1) * 2] for k, v in batch.items()} for r in range(world)])
        for rank_metrics in losses:  # bf16 gradients of half batches, summed in fp32: bf16-level agreement
            assert torch.allclose(rank_metrics["loss"], expected, rtol=2e-3)
    for name, value in single.parameters().items():
        assert relative(ranks.parameters()[name], value) < 4e-3, name  # bf16 epsilon is 7.8e-3


def test_bf16_microbatch_gradients_are_added_into_the_fp32_sum_without_a_cast_copy():
    """Accumulating microbatches in a wider reduce dtype: each later microbatch's bf16 gradient is
    added to the fp32 sum directly (the add promotes, exactly as casting first would), and training
    matches eager bf16 with fp32 masters that sums the microbatch gradients in fp32. (With the
    default Config(fuse_grad_accumulation=True) the weight matrices' products are added unrounded
    instead: tests/passes/test_fuse_grad_accumulation.py.)"""
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny"))
    master, low = copy.deepcopy(model), copy.deepcopy(model).to(torch.bfloat16)
    optimizer = torch_optimizer(ADAMW, master.parameters())
    config = fxshard.Config(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, microbatches=2,
                            fuse_grad_accumulation=False)
    step = fxshard.shard(model, loss_fn, batches(1)[0], optimizer=ADAMW, config=config)
    adds = [n for n in step.program.graph.nodes if n.target is torch.ops.aten.add.Tensor and meta.phase(n) == meta.BWD
            and n.meta["val"].dtype == torch.float32
            and any(a.meta["val"].dtype == torch.bfloat16 for a in n.all_input_nodes)]
    assert len(adds) >= len(list(model.parameters()))  # one per parameter: the second microbatch's gradient
    for index, batch in enumerate(batches(4)):
        with torch.no_grad():
            for p16, p in zip(low.parameters(), master.parameters()):
                p16.copy_(p)
        total = [torch.zeros_like(p) for p in master.parameters()]
        losses = []
        for half in range(2):
            low.zero_grad()
            loss = low.loss({k: v[half * 2:(half + 1) * 2] for k, v in batch.items()})
            (loss / 2).backward()
            losses.append(loss.item())
            for t, p16 in zip(total, low.parameters()):
                t += p16.grad.float()
        for p, t in zip(master.parameters(), total):
            p.grad = t
        optimizer.step()
        ours, eager = step(batch)["loss"].item(), sum(losses) / 2
        tolerance = 1e-6 if index == 0 else 1e-3  # as above: bf16 rounding amplifies through Adam
        assert abs(ours - eager) <= tolerance * abs(eager), (index, ours, eager)


def test_bf16_gradients_reach_adamw_without_an_fp32_copy():
    """param_dtype=bf16 on one device: every AdamW update reads its bf16 gradient as it is (the fused op
    widens it on load) and the optimizer phase writes no fp32 copy of a gradient; the grad norm is
    taken in fp32 from the bf16 gradients (parity with eager: test_bf16_compute_matches_eager_...)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny"))
    batch = {"idx": torch.randint(0, 64, (2, 16)), "tgt": torch.randint(0, 64, (2, 16))}
    step = fxshard.shard(model, lambda m, b: m.loss(b), batch, optimizer=fxshard.optim.AdamW(lr=1e-3),
                         config=fxshard.Config(param_dtype=torch.bfloat16))
    graph = step.program.graph
    updates = [n for n in graph.nodes if n.target is torch.ops.fxshard.adamw_update.default]
    assert updates and all(n.args[1].meta["val"].dtype == torch.bfloat16 for n in updates)
    casts_up = [n for n in graph.nodes if meta.phase(n) == meta.OPTIM and n.target is torch.ops.aten._to_copy.default
                and n.meta["val"].dtype == torch.float32 and n.args[0].meta["val"].dtype == torch.bfloat16
                and n.meta["val"].dim() > 0]
    assert not casts_up, [n.name for n in casts_up]


def test_float_batch_inputs_are_cast_to_param_dtype_where_they_enter_the_model():
    """As FSDP2's cast_forward_inputs: tensors passed to the model's forward take param_dtype (the
    target stays fp32 in the loss); a tensor entering another way is refused at shard(), not in step 1."""
    torch.manual_seed(0)
    model, batches = Regressor(), regression_batches(2)
    config = fxshard.Config(param_dtype=torch.bfloat16)
    step = fxshard.shard(model, regression_loss, batches[0], optimizer=ADAMW, config=config)
    loss = step(batches[0])["loss"].item()
    want = regression_loss(model, batches[0]).item()  # fp32 eager: bf16 compute agrees to bf16's precision
    assert abs(loss - want) <= 2e-2 * abs(want), (loss, want)
    with pytest.raises(fxshard.FxShardError, match=r"multiplies torch.bfloat16 by torch.float32 \(addmm.default in "
                                                   r"layers.0\).*casts the floating-point tensors passed to"):
        fxshard.shard(model, lambda m, b: ((m.forward(b["x"]) - b["y"]) ** 2).mean(), batches[0], config=config)


def test_batchnorm_keeps_fp32_weights_and_statistics_under_bf16_compute():
    """As torch's FSDP MixedPrecision does: BatchNorm's weight and bias are not cast (its kernels need
    them in its statistics' dtype next to a bf16 input); everything else computes in bf16. Against an
    eager copy holding the same mix, with fp32 masters."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    master, low = copy.deepcopy(model), copy.deepcopy(model)
    for index in (0, 3):
        low[index].to(torch.bfloat16)

    def mse(m, batch):
        return ((m(batch["x"]).float() - batch["y"]) ** 2).mean()

    generator = torch.Generator().manual_seed(2)
    data = [{"x": torch.randn(8, 8, generator=generator), "y": torch.randn(8, 1, generator=generator)} for _ in range(4)]
    step = fxshard.shard(model, mse, data[0], optimizer=ADAMW, config=MIXED)
    optimizer = torch_optimizer(ADAMW, master.parameters())
    for index, batch in enumerate(data):
        with torch.no_grad():
            for p_low, p in zip(low.parameters(), master.parameters()):
                p_low.copy_(p)
        low.zero_grad()
        eager = mse(low, {"x": batch["x"].to(torch.bfloat16), "y": batch["y"]})
        eager.backward()
        for p_low, p in zip(low.parameters(), master.parameters()):
            p.grad = p_low.grad.float()
        optimizer.step()
        ours = step(batch)["loss"].item()
        assert abs(ours - eager.item()) <= (0.0 if index == 0 else 1e-3) * abs(eager.item()), (index, ours, eager.item())
    buffers = step.buffers()  # the statistics, updated in fp32 from the bf16 activations, as eager's
    assert buffers["1.running_mean"].dtype == torch.float32
    assert relative(buffers["1.running_var"], low[1].running_var) < 1e-3
    assert relative(buffers["1.running_mean"], low[1].running_mean) < 1e-3
    tied = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    tied[0].bias = tied[1].bias  # one tensor cannot be both fp32 (BatchNorm's) and bf16 (the Linear's)
    with pytest.raises(fxshard.FxShardError, match=r"parameter 0\.bias is also a BatchNorm's weight or bias"):
        fxshard.shard(tied, mse, data[0], optimizer=ADAMW, config=MIXED)


def test_a_bf16_parameters_adamw_update_rounds_once_as_torchs():
    """A parameter kept in bf16 (not fp32 masters) is updated by fxshard's AdamW bit for bit as by
    torch.optim.AdamW, whose addcdiv_ computes in float32 and rounds once; rounding the quotient and
    the scaled step to bf16 first moved 1 element in 10 by one bf16 step within 20 steps."""
    from fxshard.ops.adamw import adamw_reference

    generator = torch.Generator().manual_seed(0)
    start = torch.randn(4096, generator=generator).to(torch.bfloat16)
    grads = [torch.randn(4096, generator=generator).to(torch.bfloat16) for _ in range(20)]
    lr, beta1, beta2, eps, decay = 1e-2, 0.9, 0.95, 1e-8, 0.1
    param = start.clone().requires_grad_(True)
    reference = torch.optim.AdamW([param], lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=decay, foreach=False)
    ours, exp_avg, exp_avg_sq = start.clone(), torch.zeros_like(start), torch.zeros_like(start)
    for step, grad in enumerate(grads, 1):
        param.grad = grad.clone()
        reference.step()
        ours, exp_avg, exp_avg_sq = adamw_reference(
            ours, grad, exp_avg, exp_avg_sq, torch.tensor(1 - lr * decay), torch.tensor(lr / (1 - beta1 ** step)),
            torch.tensor(math.sqrt(1 - beta2 ** step)), beta1, beta2, eps)
        assert torch.equal(ours, param.detach()), step
