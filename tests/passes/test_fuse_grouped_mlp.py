"""The fuse_grouped_mlp pass: fuses exactly the expert MLPs it should, and changes no result."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, strategies as st

import fxshard
from fxshard.models import MoEGPT, MoEGPTConfig
from fxshard.ops import grouped_mm
from fxshard.ops.grouped_mlp_backends import ACTIVATIONS
from fxshard.passes import fuse_grouped_mlp
from fxshard.testing import eager_parity, relative

ADAMW = fxshard.optim.AdamW(lr=1e-2, weight_decay=0.1)
FUSED_OPS = {torch.ops.fxshard.grouped_mlp_fwd.default, torch.ops.fxshard.grouped_mlp_dgrad.default,
             torch.ops.fxshard.grouped_mlp_wgrad.default}

# Look-alikes: each is an expert MLP the pass must leave alone.
LOOK_ALIKES = {
    "tanh_glu": lambda h, f: torch.tanh(h[:, :f]) * h[:, f:],
    "silu_times_sigmoid": lambda h, f: F.silu(h[:, :f]) * torch.sigmoid(h[:, f:]),
    "swapped_halves": lambda h, f: F.silu(h[:, f:]) * h[:, :f],
    "exact_gelu_glu": lambda h, f: F.gelu(h[:, :f]) * h[:, f:],       # geglu is tanh-approximated
    "quick_geglu_other_alpha": lambda h, f: h[:, :f] * torch.sigmoid(1.5 * h[:, :f]) * (h[:, f:] + 1),
    "silu_non_gated_on_gated_width": lambda h, f: F.silu(h)[:, :f],
}


class Experts(nn.Module):
    """Routes tokens round-robin to E experts (static offsets) and runs `mlp(h) -> a` between GEMMs."""

    def __init__(self, d_model, d_ff, experts, kind, extra):
        super().__init__()
        width = 2 * d_ff if kind in LOOK_ALIKES or ACTIVATIONS[kind].gated else d_ff
        self.w1 = nn.Parameter(torch.randn(experts, width, d_model) * 0.3)
        self.w_mid = nn.Parameter(torch.randn(experts, d_ff, d_ff) * 0.3) if extra == "chain" else None
        self.w2 = nn.Parameter(torch.randn(experts, d_model + (extra == "wider_output"), d_ff) * 0.3)
        if extra == "stored":  # experts stored [E, in, out] (Llama 4's layout), passed to the GEMMs transposed
            self.w1, self.w2 = (nn.Parameter(w.detach().transpose(1, 2).contiguous()) for w in (self.w1, self.w2))
        self.b1 = nn.Parameter(torch.randn(width) * 0.1) if extra == "bias" else None
        self.kind, self.extra, self.d_ff = kind, extra, d_ff

    def forward(self, x):
        tokens = x.shape[0]
        experts = self.w1.shape[0]
        counts = torch.full((experts,), tokens // experts, dtype=torch.int32)
        counts[0] += tokens % experts
        offsets = counts.cumsum(0).to(torch.int32)
        w1, w2 = (w.transpose(1, 2) for w in (self.w1, self.w2)) if self.extra == "stored" else (self.w1, self.w2)
        h = grouped_mm(x, offsets, w1)
        if self.b1 is not None:
            h = h + self.b1
        if self.kind in ACTIVATIONS:
            a = ACTIVATIONS[self.kind].torch(h, 7.0)
        else:
            a = LOOK_ALIKES[self.kind](h, self.d_ff)
        if self.extra == "chain":  # a third GEMM: (h, mid) and (mid, y) both match, sharing mid
            a = torch.relu(grouped_mm(a, offsets, self.w_mid))
        second = offsets.flip(0).cumsum(0).to(torch.int32) if self.extra == "other_offsets" else offsets
        y = grouped_mm(a, second, w2)
        if self.extra == "wider_output":  # D -> F -> D + 1: the fused op's shapes do not fit
            y = y[:, :-1]
        if self.extra == "reads_h":
            y = y + h[:, :1]
        if self.extra == "reads_a":
            y = y + a.mean()
        return y


class Net(nn.Module):
    def __init__(self, d_model, d_ff, experts, kind, extra, layers):
        super().__init__()
        self.inp = nn.Linear(3, d_model)
        self.layers = nn.ModuleList(Experts(d_model, d_ff, experts, kind, extra) for _ in range(layers))

    def forward(self, x):
        x = self.inp(x)
        for layer in self.layers:
            x = x + layer(x)
        return x


def mse(model, batch):
    return (model(batch["x"]) ** 2).mean()


def run_both(model, rows, microbatches=1):
    generator = torch.Generator().manual_seed(1)
    batch = {"x": torch.randn(rows, 3, generator=generator)}
    program = fxshard.trace(model, mse, batch, optimizer=ADAMW, config=fxshard.Config(microbatches=microbatches))
    fused = fuse_grouped_mlp(program)
    args = []
    for spec, node in zip(program.inputs, program.placeholders()):
        value = node.meta["val"]
        if spec.kind.name == "LR":
            args.append(torch.tensor(1e-2))
        elif spec.kind.name == "STEP":
            args.append(torch.tensor(3.0))
        elif spec.kind.name == "BATCH":
            args.append(batch["x"])
        elif spec.kind.name == "PARAM":
            args.append(dict(model.named_parameters())[spec.name].detach().clone())
        else:
            args.append(torch.rand(value.shape, generator=generator))
    return program, fused, program.graph_module(*args), fused.graph_module(*args)


def count_fused(program):
    return sum(1 for n in program.graph.nodes if n.target is torch.ops.fxshard.grouped_mlp_fwd.default)


@given(activation=st.sampled_from(sorted(ACTIVATIONS)), experts=st.integers(1, 4), d_model=st.integers(2, 6),
       d_ff=st.integers(1, 5), layers=st.integers(1, 2), microbatches=st.sampled_from([1, 2]),
       rows=st.integers(4, 9), stored=st.booleans())
def test_matching_expert_mlps_are_fused_and_results_are_unchanged(activation, experts, d_model, d_ff, layers,
                                                                  microbatches, rows, stored):
    """`stored`: experts stored [E, in, out] and read transposed; fused too, and the gradient AdamW
    reads stays contiguous (fxshard/ops/grouped_mm.py makes it in the stored layout)."""
    torch.manual_seed(0)
    model = Net(d_model, d_ff, experts, activation, "stored" if stored else None, layers)
    rows = rows * microbatches
    original, fused, expected, actual = run_both(model, rows, microbatches)
    assert count_fused(fused) == layers * microbatches
    for n in fused.graph.nodes:  # no unfused grouped GEMM is left
        assert n.target not in (torch.ops.fxshard.grouped_mm.default, torch.ops.fxshard.grouped_mm_wgrad.default)
    wgrads = [n for n in fused.graph.nodes if n.target is torch.ops.fxshard.grouped_mlp_wgrad.default]
    assert len(wgrads) == layers * microbatches  # the weight gradient runs once per fused MLP
    for ours, want in zip(actual, expected):
        torch.testing.assert_close(ours, want, rtol=1e-5, atol=1e-6)
    updates = [n for n in fused.graph.nodes if n.target is torch.ops.fxshard.adamw_update.default]
    assert updates and all(n.args[1].meta["val"].is_contiguous() for n in updates)


@given(kind=st.sampled_from(sorted(LOOK_ALIKES)), experts=st.integers(1, 3), d_ff=st.integers(1, 4))
def test_look_alike_activations_are_left_alone(kind, experts, d_ff):
    torch.manual_seed(0)
    _, fused, expected, actual = run_both(Net(4, d_ff, experts, kind, None, 1), 6)
    assert count_fused(fused) == 0
    for ours, want in zip(actual, expected):
        assert torch.equal(ours, want)


@given(extra=st.sampled_from(["reads_h", "reads_a", "bias", "other_offsets"]),
       activation=st.sampled_from(["swiglu", "relu"]), experts=st.integers(1, 3))
def test_extra_consumers_biases_and_mismatched_offsets_block_the_fusion(extra, activation, experts):
    torch.manual_seed(0)
    _, fused, expected, actual = run_both(Net(4, 3, experts, activation, extra, 1), 6)
    assert count_fused(fused) == 0
    for ours, want in zip(actual, expected):
        assert torch.equal(ours, want)


def test_a_chain_of_three_expert_gemms_is_fused_once_and_a_wider_output_not_at_all():
    torch.manual_seed(0)
    _, fused, expected, actual = run_both(Net(4, 4, 2, "relu", "chain", 1), 6)
    assert count_fused(fused) == 1
    for ours, want in zip(actual, expected):
        torch.testing.assert_close(ours, want, rtol=1e-5, atol=1e-6)
    _, fused, expected, actual = run_both(Net(4, 3, 2, "relu", "wider_output", 1), 6)
    assert count_fused(fused) == 0
    for ours, want in zip(actual, expected):
        assert torch.equal(ours, want)


@pytest.mark.parametrize("layout", [{}, {"capacity_factor": 1.0, "expert_slots": True}],
                         ids=["dropless", "capacity-slots"])
def test_moe_gpt_trains_the_same_fused_for_10_steps(layout):
    torch.manual_seed(0)
    cfg = MoEGPTConfig.preset("tiny", **layout)
    generator = torch.Generator().manual_seed(0)
    batches = [{"idx": torch.randint(0, 64, (4, 32), generator=generator),
                "tgt": torch.randint(0, 64, (4, 32), generator=generator)} for _ in range(10)]
    optimizer = fxshard.optim.AdamW(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    model = MoEGPT(cfg)
    fused = eager_parity(model, lambda m, b: m.loss(b), batches, optimizer,
                         config=fxshard.Config(fuse_grouped_mlp=True))
    assert fused.max_loss_rel < 1e-5, fused.losses
    assert fused.max_param_rel < 1e-4
    step = fxshard.shard(model, lambda m, b: m.loss(b), batches[0], optimizer=optimizer,
                         config=fxshard.Config(fuse_grouped_mlp=True))
    assert step.programs[1].name == "fuse_grouped_mlp"
    assert count_fused(step.programs[1]) == cfg.n_layer
    capacities = {n.args[8] if len(n.args) > 8 else None for n in step.programs[1].graph.nodes
                  if n.target is torch.ops.fxshard.grouped_mlp_fwd.default}
    assert capacities == ({None} if not layout else {4 * 32 * 2 // 4})  # tokens * top_k / experts, factor 1


def test_the_dump_shows_the_fused_ops(tmp_path):
    torch.manual_seed(0)
    model = MoEGPT(MoEGPTConfig.preset("tiny"))
    batch = {"idx": torch.zeros(2, 8, dtype=torch.long), "tgt": torch.zeros(2, 8, dtype=torch.long)}
    fxshard.shard(model, lambda m, b: m.loss(b), batch, config=fxshard.Config(fuse_grouped_mlp=True,
                                                                             dump_dir=str(tmp_path)))
    text = next(tmp_path.glob("*fuse_grouped_mlp*.py")).read_text()
    assert text.count("grouped_mlp_fwd") >= 2 and "grouped_mlp_wgrad" in text
    summary = next(tmp_path.glob("*fuse_grouped_mlp*summary*")).read_text()
    assert "layers.0: swiglu" in summary


@pytest.mark.parametrize("strategy", ["no_shard", "optim_grads_params"])
def test_fused_program_shards_like_the_unfused_one(strategy):
    """fuse_grouped_mlp then fsdp (the pipeline's order) on 2 simulated ranks equals fsdp alone."""
    from fxshard.passes.fsdp import FSDPConfig, fsdp
    from fxshard.testing import SimulatedRanks

    torch.manual_seed(0)
    model = MoEGPT(MoEGPTConfig.preset("tiny"))
    generator = torch.Generator().manual_seed(2)
    local = [{"idx": torch.randint(0, 64, (2, 8), generator=generator),
              "tgt": torch.randint(0, 64, (2, 8), generator=generator)} for _ in range(2)]
    # lr 1e-3 as in the other parity tests: at 1e-2 AdamW turns last-bit gradient differences of
    # near-zero elements into ~1e-4 relative parameter differences within three steps
    optimizer = fxshard.optim.AdamW(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    program = fxshard.trace(model, lambda m, b: m.loss(b), local[0], optimizer=optimizer)
    runs = []
    for source in (program, fuse_grouped_mlp(program)):
        ranks = SimulatedRanks(fsdp(source, FSDPConfig(2, strategy)), model, optimizer, fxshard.Mesh(dp=2))
        losses = [ranks.step(local)[0]["loss"] for _ in range(3)]
        runs.append((losses, ranks.parameters(0)))
    (plain_losses, plain_params), (fused_losses, fused_params) = runs
    for a, b in zip(plain_losses, fused_losses):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    for name, value in plain_params.items():  # relative to the tensor's largest element, as elsewhere
        assert relative(fused_params[name], value) < 1e-4, name
