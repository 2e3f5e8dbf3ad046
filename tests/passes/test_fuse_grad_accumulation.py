"""The fuse_grad_accumulation pass: each microbatch's weight gradient added into its float32 total by
the weight-gradient matmul itself (`fxshard::matmul_accumulate`), on one device and in pipelines."""

import torch
from hypothesis import assume, given, settings, strategies as st

import fxshard
from fxshard.codegen import is_fixed
from fxshard.models import GPT, GPTConfig
from fxshard.passes import run_pipeline
import torch.fx as fx

from fxshard import meta
from fxshard.passes.fuse_grad_accumulation import fuse_grad_accumulation, fuse_in_graph
from fxshard.testing import SimulatedRanks

PRECISION = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}
SGD = fxshard.optim.SGD(lr=1.0)  # one step from the same weights: the update is minus the gradient


def _traced(model, batch, pp: int, microbatches: int):
    """The traced program shard() would pass through the pass list (for pp > 1: of one microbatch)."""
    if pp == 1:
        config = fxshard.Config(microbatches=microbatches, **PRECISION)
        return fxshard.trace(model, lambda m, b: m.loss(b), batch, optimizer=SGD, config=config)
    one = {k: v[:1] for k, v in batch.items()}  # the pipeline splits the program of one microbatch
    return fxshard.trace(model, lambda m, b: m.loss(b), one, optimizer=SGD, config=fxshard.Config(**PRECISION))


def _programs(traced, pp: int, microbatches: int, fuse: bool):
    """Each stage's program (one for pp=1) after the pass list, with the pass on or off."""
    config = fxshard.Config(microbatches=microbatches, fuse_grad_accumulation=fuse, sharding="no_shard", **PRECISION)
    if pp == 1:
        return [run_pipeline(traced, None, config)[-1]]
    return [run_pipeline(traced, fxshard.Mesh(pp=pp), config, stage=s)[-1] for s in range(pp)]


@settings(max_examples=4)  # each example traces GPT (~3 s on the 2-core CI machine)
@given(pp=st.sampled_from([1, 2]), microbatches=st.sampled_from([2, 3, 4]), seed=st.integers(0, 3))
def test_fused_accumulation_computes_the_unfused_gradients_up_to_the_products_rounding(pp, microbatches, seed):
    """One SGD step (lr 1) of the program with and without the pass on the SPMD simulator: the same
    loss, and each parameter's update (its gradient) equal up to the bf16 rounding of each
    microbatch's matmul product (and embedding gradient) that the fused program no longer does;
    every weight matrix's and the embedding's accumulation is fused, once per microbatch after the first,
    and each weight matrix's first product is computed in float32 (`fxshard::matmul_wide`)."""
    torch.manual_seed(seed)
    model = GPT(GPTConfig(vocab_size=64, d_model=32, n_layer=2, n_head=2, d_ff=64))
    batch = {k: torch.randint(0, 64, (microbatches, 8), generator=torch.Generator().manual_seed(seed + i))
             for i, k in enumerate(("idx", "tgt"))}
    mesh = fxshard.Mesh(pp=pp) if pp > 1 else fxshard.Mesh()
    traced, runs = _traced(model, batch, pp, microbatches), []
    for fuse in (False, True):
        programs = _programs(traced, pp, microbatches, fuse)
        ranks = SimulatedRanks(programs, model, SGD, mesh)
        before = [{k: v.clone() for k, v in state.items()} for state in ranks.states]
        runs.append((programs, ranks.step([batch] * ranks.world), before, ranks.states))
    (plain, plain_out, start, plain_after), (fused, fused_out, _, fused_after) = runs
    assert [o["loss"] for o in fused_out] == [o["loss"] for o in plain_out]  # the forward is untouched
    matrices = sum(1 for p in model.parameters() if p.dim() == 2)  # the embedding's rows are fused too
    assert sum(p.notes.get("fuse_grad_accumulation", 0) for p in fused) == matrices * (microbatches - 1)
    assert sum(n.target is torch.ops.fxshard.embedding_accumulate.default for p in fused
               for n in p.graph.nodes) == microbatches - 1
    # the first microbatch's product of each weight matrix (all but the embedding, whose first gradient is
    # its rows) is computed in float32 too, by one op
    assert sum(n.target is torch.ops.fxshard.matmul_wide.default for p in fused for n in p.graph.nodes) == matrices - 1
    assert all("fuse_grad_accumulation" not in p.notes for p in plain)
    for rank, state in enumerate(start):
        for key, value in state.items():
            if not value.is_floating_point():
                continue
            want, got = value - plain_after[rank][key], value - fused_after[rank][key]
            scale = want.abs().max().item()
            torch.testing.assert_close(got, want, rtol=0, atol=2 ** -7 * scale * microbatches, msg=str(key))


def test_programs_without_a_widened_product_are_left_as_they_are_and_the_dump_shows_the_op():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, d_model=32, n_layer=2, n_head=2, d_ff=64))
    batch = {k: torch.zeros(2, 8, dtype=torch.long) for k in ("idx", "tgt")}
    fp32 = fxshard.trace(model, lambda m, b: m.loss(b), batch, optimizer=SGD,
                         config=fxshard.Config(microbatches=2))
    assert fuse_grad_accumulation(fp32) is fp32  # float32 compute: every product is already exact
    (fused,) = _programs(_traced(model, batch, 1, 2), 1, 2, True)
    ops = (torch.ops.fxshard.matmul_accumulate.default, torch.ops.fxshard.embedding_accumulate.default)
    nodes = [n for n in fused.graph.nodes if n.target in ops]
    assert len(nodes) == fused.notes["fuse_grad_accumulation"] > 0
    assert all(f"torch.ops.{op}" in fused.graph_module.code for op in ops)
    assert not any(is_fixed(n) for n in nodes)  # codegen compiles it inside its layer's region


@given(padding_idx=st.sampled_from([-1, 0, 3]), seed=st.integers(0, 7))
def test_embedding_accumulate_adds_the_rows_of_the_dense_gradient(padding_idx, seed):
    """embedding_accumulate (and its in-place form) against total + the dense embedding backward:
    repeated indices summed, the padding row left as it is; rows summed in float32, not rounded
    to bf16 first."""
    generator = torch.Generator().manual_seed(seed)
    indices = torch.randint(0, 6, (2, 9), generator=generator)  # 18 lookups of 6 rows: repeats
    grad = torch.randn(2, 9, 4, generator=generator).bfloat16()
    total = torch.randn(6, 4, generator=generator)
    dense = torch.ops.aten.embedding_dense_backward(grad.double(), indices, 6, padding_idx, False)
    exact = total.double() + dense
    got = torch.ops.fxshard.embedding_accumulate(total, grad, indices, padding_idx)
    torch.testing.assert_close(got.double(), exact, rtol=1e-6, atol=1e-6)
    in_place = total.clone()
    torch.ops.fxshard.embedding_accumulate_(in_place, grad, indices, padding_idx)
    assert torch.equal(in_place, got)
    if padding_idx >= 0:
        assert torch.equal(got[padding_idx], total[padding_idx])


def test_matmul_accumulate_adds_the_unrounded_product():
    a = torch.randn(5, 7, dtype=torch.bfloat16)
    b = torch.randn(7, 3, dtype=torch.bfloat16)
    total = torch.randn(5, 3)
    got = torch.ops.fxshard.matmul_accumulate(total, a, b)
    torch.testing.assert_close(got, total + a.double().matmul(b.double()).float(), rtol=1e-6, atol=1e-6)
    assert got.dtype == torch.float32 and not torch.equal(got, total + (a @ b).float())  # not rounded to bf16 first


@given(transposes=st.integers(0, 3), widened=st.booleans(), narrow_total=st.booleans())
def test_a_transposed_or_promoted_product_is_fused_into_the_right_matmul(transposes, widened, narrow_total):
    """total + widen(T(mm(a, b))) on a graph of its own, for any number of transposes, a widening cast
    or the addition's own promotion, and a bf16 total (the first microbatch's): the fused graph
    computes the same sum up to the product's bf16 rounding, with one fxshard::matmul_accumulate."""
    assume(widened or not narrow_total)  # bf16 + bf16 stays bf16: no float32 total to fuse into
    generator = torch.Generator().manual_seed(transposes)
    a = torch.randn(5, 4, generator=generator).bfloat16()
    b = torch.randn(4, 3, generator=generator).bfloat16()
    shape = (5, 3) if transposes % 2 == 0 else (3, 5)
    total = torch.randn(shape, generator=generator).to(torch.bfloat16 if narrow_total else torch.float32)
    graph = fx.Graph()
    aten = torch.ops.aten

    def add(target, args, value, kwargs=None):
        node = graph.call_function(target, args, kwargs or {})
        node.meta.update({meta.PHASE: meta.BWD, "val": value})
        return node
    inputs = [graph.placeholder(name) for name in ("total", "a", "b")]
    for node, value in zip(inputs, (total, a, b)):
        node.meta["val"] = value
    value = a @ b
    product = add(aten.mm.default, (inputs[1], inputs[2]), value)
    for _ in range(transposes):
        value = value.t()
        product = add(aten.t.default, (product,), value)
    if widened:
        value = value.float()
        product = add(aten._to_copy.default, (product,), value, {"dtype": torch.float32})
    graph.output(add(aten.add.Tensor, (inputs[0], product), (total.float() + value.float())))
    want = fx.GraphModule(torch.nn.Module(), graph)(total, a, b)
    assert fuse_in_graph(graph) == 1
    graph.lint()
    fused = fx.GraphModule(torch.nn.Module(), graph)
    assert [n.target for n in graph.nodes if n.op == "call_function"].count(
        torch.ops.fxshard.matmul_accumulate.default) == 1 and not any(
        n.target is aten.mm.default for n in graph.nodes)
    exact = total.double() + (a.double() @ b.double()).t().double() if transposes % 2 else \
        total.double() + a.double() @ b.double()
    got = fused(total, a, b)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), exact, rtol=1e-6, atol=1e-6)  # the product was not rounded
    torch.testing.assert_close(got, want, rtol=0, atol=2 ** -7 * want.abs().max().item())
