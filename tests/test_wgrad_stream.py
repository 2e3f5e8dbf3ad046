"""The side-stream lowering of expert weight gradients (fxshard/runtime/wgrad_stream.py), on CPU:
which nodes it moves, where the compute stream joins, and that the program computes the same."""

import operator

import pytest
import torch

import fxshard
from fxshard.models import MoEGPT, MoEGPTConfig
from fxshard.runtime.wgrad_stream import join_side_stream, weight_grads_on_side_stream

WGRADS = ("grouped_mlp_wgrad", "grouped_mm_wgrad")


def _program(fuse):
    torch.manual_seed(0)
    model = MoEGPT(MoEGPTConfig.preset("tiny"))
    batch = {"idx": torch.randint(0, 64, (2, 8)), "tgt": torch.randint(0, 64, (2, 8))}
    step = fxshard.shard(model, lambda m, b: m.loss(b), batch, optimizer=fxshard.optim.AdamW(lr=1e-3),
                         config=fxshard.Config(fuse_grouped_mlp=fuse))
    return step.program, model, batch


@pytest.mark.parametrize("fuse, per_layer", [(True, 1), (False, 2)])
def test_each_expert_weight_gradient_moves_and_is_joined_before_its_first_reader(fuse, per_layer):
    program, model, _ = _program(fuse)
    lowered, count = weight_grads_on_side_stream(program.graph_module)
    assert count == per_layer * model.cfg.n_layer
    assert not any(getattr(n.target, "_opname", None) in WGRADS for n in lowered.graph.nodes)
    position = {node: i for i, node in enumerate(lowered.graph.nodes)}
    joins = [n for n in lowered.graph.nodes if n.target is join_side_stream]
    assert len(joins) == count
    for join in joins:
        (side,) = join.args
        assert position[side] < position[join]
        assert list(side.users) == [join]  # nothing reads the side-stream result but the join
        readers = [r for u in join.users for r in (u.users if u.target is operator.getitem else [u])]
        assert readers and all(position[join] < position[r] for r in readers)
    # everything else is where it was, in the same order
    others = [n.name for n in program.graph.nodes if getattr(n.target, "_opname", None) not in WGRADS
              and n.target is not operator.getitem]
    kept = [n.name for n in lowered.graph.nodes if n.op != "call_function" or
            (n.target is not join_side_stream and n.target is not operator.getitem and
             not n.target.__name__.endswith("_on_side_stream"))]
    assert kept == others


def test_the_lowered_program_computes_the_same():
    program, _, _ = _program(True)
    lowered, _ = weight_grads_on_side_stream(program.graph_module)
    generator = torch.Generator().manual_seed(3)
    args = []
    for node in program.placeholders():
        value = node.meta["val"]
        if value.dtype.is_floating_point:
            args.append(torch.rand(value.shape, generator=generator, dtype=value.dtype))
        else:
            args.append(torch.randint(0, 8, value.shape, generator=generator, dtype=value.dtype))
    for ours, want in zip(lowered(*args), program.graph_module(*args)):
        assert torch.equal(ours, want)


def test_config_turns_it_on_only_on_cuda():
    program, model, batch = _program(True)
    step = fxshard.shard(model, lambda m, b: m.loss(b), batch, optimizer=fxshard.optim.AdamW(lr=1e-3),
                         config=fxshard.Config(fuse_grouped_mlp=True, wgrad_side_stream=True))
    assert step.side_stream_wgrads == 0  # CPU: nothing to overlap with
