"""The runtime's lowering of a unit's flat gradient to a buffer its GEMMs accumulate into
(fxshard/runtime/flat_gradients.py)."""

import torch
from hypothesis import given, settings, strategies as st

import fxshard
from fxshard.models import GPT, GPTConfig
from fxshard.runtime.flat_gradients import flat_gradients_in_place
from fxshard.runtime.reinplace import accumulate_in_place

_ops = torch.ops.fxshard
_LOWERED = (_ops.flat_buffer.default, _ops.matmul_wide_at_.default, _ops.matmul_accumulate_at_.default,
            _ops.copy_at_.default)


class _Values(torch.fx.Interpreter):
    """Runs the graph once, leaving each tensor node's meta["val"] as the passes do (the lowering reads
    shapes and dtypes there)."""

    def run_node(self, node):
        result = super().run_node(node)
        if isinstance(result, torch.Tensor):
            node.meta["val"] = torch.empty(result.shape, dtype=result.dtype)
        return result


def _fake(graph_module, args):
    _Values(graph_module).run(*args)


@settings(max_examples=25, deadline=None)
@given(parts=st.lists(st.tuples(st.sampled_from(["gemm", "gemm", "plain", "read twice", "late"]),
                                st.integers(1, 4), st.integers(1, 4), st.integers(0, 3)), min_size=1, max_size=5),
       seed=st.integers(0, 2**16))
def test_the_flat_buffer_holds_what_the_cat_did_bit_for_bit(parts, seed):
    """A cat of parts, each the total of a wide GEMM and 0-3 in-place accumulations into it ("gemm"), a
    tensor of its own ("plain"), such a total that something else also reads ("read twice") or that
    is accumulated into after the cat ("late"): lowered where the GEMM totals hold at least 90% of the
    elements, the graph returns the same values bit for bit; left alone otherwise."""
    graph = torch.fx.Graph()
    a_in, b_in = graph.placeholder("a"), graph.placeholder("b")
    generator = torch.Generator().manual_seed(seed)
    args, flats, extra, late = [torch.randn(4, 6, generator=generator).bfloat16(),
                                torch.randn(6, 4, generator=generator).bfloat16()], [], [], []
    lowerable = 0
    for kind, rows, columns, accumulations in parts:
        a = graph.call_function(torch.ops.aten.slice.Tensor, (a_in, 0, 0, rows))
        b = graph.call_function(torch.ops.aten.slice.Tensor, (b_in, 1, 0, columns))
        if kind == "plain":
            total = graph.call_function(torch.ops.aten.mul.Tensor, (graph.call_function(_ops.matmul_wide.default,
                                                                                        (a, b, torch.float32)), 3.0))
        else:
            total = graph.call_function(_ops.matmul_wide.default, (a, b, torch.float32))
            for _ in range(accumulations):
                graph.call_function(_ops.matmul_accumulate_.default, (total, a, b))
            lowerable += rows * columns if kind == "gemm" else 0
            if kind == "read twice":
                extra.append(graph.call_function(torch.ops.aten.sum.default, (total,)))
            if kind == "late":
                late.append((total, a, b))
        flats.append(graph.call_function(torch.ops.aten.view.default, (total, [-1])))
    cat = graph.call_function(torch.ops.aten.cat.default, (flats,))
    for total, a, b in late:
        graph.call_function(_ops.matmul_accumulate_.default, (total, a, b))
    graph.output((graph.call_function(torch.ops.aten.mul.Tensor, (cat, 1.0)), *extra))
    module = torch.fx.GraphModule(torch.nn.Module(), graph)
    _fake(module, args)
    lowered, count = flat_gradients_in_place(module)
    numel = sum(rows * columns for _, rows, columns, _ in parts)
    assert count == (lowerable >= 0.9 * numel)
    if count:
        assert torch.ops.aten.cat.default not in [n.target for n in lowered.graph.nodes]
    for want, got in zip(module(*args), lowered(*args)):
        assert torch.equal(want, got)


def test_a_pipeline_stages_flat_gradients_accumulate_in_place_and_train_bit_identically():
    """GPT at pp=2, M=3, bf16 compute with fp32 gradients: each stage's block unit (and the last
    stage's head with the final norm) is accumulated in its flat buffer, the embedding's unit (a row
    sum, not a GEMM) keeps its cat; on the SPMD simulator the lowered stages train bit-identically."""
    from fxshard.passes import run_pipeline
    from fxshard.testing import assert_bit_identical

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=32, d_model=16, n_layer=2, n_head=2, d_ff=32))
    adamw, mesh = fxshard.optim.AdamW(lr=1e-2, weight_decay=0.1), fxshard.Mesh(pp=2)
    precision = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}
    generator = torch.Generator().manual_seed(0)
    one = {k: torch.randint(0, 32, (1, 8), generator=generator) for k in ("idx", "tgt")}
    traced = fxshard.trace(model, lambda m, b: m.loss(b), one, optimizer=adamw, config=fxshard.Config(**precision))
    config = fxshard.Config(microbatches=3, sharding="no_shard", **precision)
    stages = [run_pipeline(traced, mesh, config, stage=s)[-1] for s in range(2)]
    accumulated, lowered = [], []
    for stage, expected in zip(stages, (1, 2)):
        graph_module = accumulate_in_place(stage.graph_module)[0]
        flat, count = flat_gradients_in_place(graph_module)
        assert count == expected
        targets = [n.target for n in flat.graph.nodes]
        assert targets.count(_ops.flat_buffer.default) == count and _ops.matmul_wide.default not in targets
        assert _ops.matmul_accumulate_.default not in targets  # every GEMM total accumulates in a flat buffer
        accumulated.append(stage.replace(graph_module=graph_module))
        lowered.append(stage.replace(graph_module=flat))
    batches = [{k: torch.randint(0, 32, (3, 8), generator=generator) for k in ("idx", "tgt")}] * 2
    assert_bit_identical([accumulated, lowered], model, adamw, mesh, batches, steps=2)


def test_flat_gradients_reduced_over_dp_are_accumulated_in_place_and_train_bit_identically():
    """ZeRO-2 over dp=2, M=3, bf16 compute with fp32 gradients: each block's flat gradient, the
    reduce-scatter's input, is the buffer its GEMMs accumulate into; bit-identical on the simulator."""
    from fxshard.passes import run_pipeline
    from fxshard.testing import assert_bit_identical

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=32, d_model=16, n_layer=2, n_head=2, d_ff=32))
    adamw, mesh = fxshard.optim.AdamW(lr=1e-2, weight_decay=0.1), fxshard.Mesh(dp=2)
    generator = torch.Generator().manual_seed(0)
    local = [{k: torch.randint(0, 32, (3, 8), generator=generator) for k in ("idx", "tgt")} for _ in range(2)]
    config = fxshard.Config(microbatches=3, sharding="optim_grads", param_dtype=torch.bfloat16,
                            reduce_dtype=torch.float32)
    traced = fxshard.trace(model, lambda m, b: m.loss(b), local[0], optimizer=adamw, config=config)
    program = run_pipeline(traced, mesh, config)[-1]
    accumulated = accumulate_in_place(program.graph_module)[0]
    flat, count = flat_gradients_in_place(accumulated)
    assert count == 3  # the two blocks and "post" (the head); "pre" (the embedding's row sums) keeps its cat
    reduced = [n for n in flat.graph.nodes if n.target is torch.ops._c10d_functional.reduce_scatter_tensor.default]
    assert sum(n.args[0].target is _ops.flat_buffer.default for n in reduced) == count
    assert_bit_identical([program.replace(graph_module=accumulated), program.replace(graph_module=flat)],
                         model, adamw, mesh, local)
