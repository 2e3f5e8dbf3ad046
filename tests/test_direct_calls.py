"""fxshard's ops called as their Python bodies in the replayed graph (fxshard/runtime/direct_calls.py)."""

import dataclasses

import torch

import fxshard
from fxshard.models import GPT, GPTConfig
from fxshard.runtime.direct_calls import COMMUNICATION, body_of, call_directly
from fxshard.runtime.flat_gradients import flat_gradients_in_place
from fxshard.runtime.reinplace import accumulate_in_place

_ops = torch.ops.fxshard
PRECISION = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}


def _model():
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=32, d_model=16, n_layer=2, n_head=2, d_ff=32))


def _ops_left(graph_module) -> set:
    return {n.target for n in graph_module.graph.nodes
            if isinstance(n.target, torch._ops.OpOverload) and n.target.namespace == "fxshard"}


def test_only_fxshards_one_kernel_ops_have_a_body_to_call_and_transfers_keep_theirs():
    assert body_of(_ops.matmul_accumulate_at_.default).__name__ == "matmul_accumulate_at_"
    assert body_of(_ops.adamw_update_.default).__name__ == "adamw_update_"
    assert all(body_of(op) is None for op in COMMUNICATION)  # the step names a failed transfer by its op
    assert body_of(torch.ops.aten.mm.default) is None and body_of(torch.ops.aten.add_.Tensor) is None


def test_a_step_calls_its_ops_bodies_and_trains_bit_identically():
    """bf16 compute, fp32 gradients over 3 microbatches, AdamW, aten replay: the step calls every
    fxshard op it runs as the op's body (the wide first-microbatch GEMMs, the in-place accumulations,
    the embedding's row sums, AdamW), says how many in `lowerings()`, and trains bit for bit as the
    step that dispatches them (Config(direct_calls=False))."""
    generator = torch.Generator().manual_seed(1)
    batches = [{k: torch.randint(0, 32, (3, 8), generator=generator) for k in ("idx", "tgt")} for _ in range(3)]
    adamw = fxshard.optim.AdamW(lr=1e-2, weight_decay=0.1)
    config = fxshard.Config(microbatches=3, **PRECISION)
    direct = fxshard.shard(_model(), lambda m, b: m.loss(b), batches[0], optimizer=adamw, config=config)
    dispatched = fxshard.shard(_model(), lambda m, b: m.loss(b), batches[0], optimizer=adamw,
                               config=dataclasses.replace(config, direct_calls=False))
    assert direct.direct_calls > 0 and f"{direct.direct_calls} calls of fxshard ops past the dispatcher" \
        in direct.lowerings() and dispatched.direct_calls == 0
    assert not _ops_left(direct._run) and _ops_left(dispatched._run)
    for batch in batches:
        assert torch.equal(direct(batch)["loss"], dispatched(batch)["loss"])
    trained = direct.parameters()
    for name, value in dispatched.parameters().items():
        assert torch.equal(trained[name], value), name


def test_pipeline_stages_keep_their_transfers_as_ops_and_train_bit_identically():
    """pp=2, M=3: after the runtime's gradient lowerings, each stage's fxshard compute ops are called
    as their bodies, its sends and receives stay ops, and the stages train bit-identically on the
    SPMD simulator."""
    from fxshard.passes import run_pipeline
    from fxshard.testing import assert_bit_identical

    model, adamw, mesh = _model(), fxshard.optim.AdamW(lr=1e-2, weight_decay=0.1), fxshard.Mesh(pp=2)
    generator = torch.Generator().manual_seed(0)
    one = {k: torch.randint(0, 32, (1, 8), generator=generator) for k in ("idx", "tgt")}
    traced = fxshard.trace(model, lambda m, b: m.loss(b), one, optimizer=adamw, config=fxshard.Config(**PRECISION))
    config = fxshard.Config(microbatches=3, sharding="no_shard", **PRECISION)
    lowered, direct = [], []
    for stage in (run_pipeline(traced, mesh, config, stage=s)[-1] for s in range(2)):
        graph_module = flat_gradients_in_place(accumulate_in_place(stage.graph_module)[0])[0]
        called, count = call_directly(graph_module)
        transfers = _ops_left(graph_module) & COMMUNICATION
        assert count > 0 and transfers and _ops_left(called) == transfers
        lowered.append(stage.replace(graph_module=graph_module))
        direct.append(stage.replace(graph_module=called))
    batches = [{k: torch.randint(0, 32, (3, 8), generator=generator) for k in ("idx", "tgt")}] * 2
    assert_bit_identical([lowered, direct], model, adamw, mesh, batches, steps=2)
