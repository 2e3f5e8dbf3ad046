"""Where a rank's state lies in the global tensors (fxshard/checkpoint/items.py), checked without
processes: every rank's program of a mesh is compiled in this one, its initial state built from a
model, and its pieces compared element by element with the model's global tensors."""

import math

import pytest
import torch
from hypothesis import given, strategies as st

import fxshard
from fxshard.api import _compile
from fxshard.checkpoint.items import boxes, global_tensors, model_key, state_pieces
from fxshard.models import MoEGPT, MoEGPTConfig
from fxshard.program import InputKind
from fxshard.runtime.state import initial_state
from test_foreign_models import GPT2

ADAMW = fxshard.optim.AdamW()


@given(shape=st.lists(st.integers(1, 5), min_size=0, max_size=4), data=st.data())
def test_boxes_tile_a_flat_range_with_contiguous_rectangles(shape, data):
    numel = math.prod(shape)
    start = data.draw(st.integers(0, numel), label="start")
    stop = data.draw(st.integers(start, numel), label="stop")
    flat = torch.arange(numel)
    tensor = flat.view(shape)
    covered = []
    for offsets, sizes, first in boxes(tuple(shape), start, stop):
        box = tensor
        for dim, (offset, size) in enumerate(zip(offsets, sizes)):
            box = box.narrow(dim, offset, size)
        assert box.numel() > 0
        # the box is the flat run that starts where it says: a view of a flat buffer
        assert torch.equal(box.reshape(-1), flat[first:first + box.numel()])
        covered += box.reshape(-1).tolist()
    assert covered == list(range(start, stop))
    assert len(boxes(tuple(shape), start, stop)) <= max(1, 2 * len(shape) - 1)


def moe_model():
    torch.manual_seed(0)
    # GLU-interleaved expert fc1 rows, a shared expert: units cut inside parameters at odd rank counts
    return MoEGPT(MoEGPTConfig.preset("tiny", d_model=24, n_head=2, d_ff_expert=20, d_ff_shared=12,
                                      glu_interleave_size=2))


CASES = {  # name -> (model, loss, Mesh, sharding, microbatches)
    "dp3-zero3": (moe_model, lambda m, b: m.loss(b), fxshard.Mesh(dp=3), "optim_grads_params", 1),
    "dp2-zero1": (moe_model, lambda m, b: m.loss(b), fxshard.Mesh(dp=2), "optim", 1),
    "dp4-ep2-zero3": (moe_model, lambda m, b: m.loss(b), fxshard.Mesh(dp=4, ep=2), "optim_grads_params", 1),
    "dp2-ep2-no-shard": (moe_model, lambda m, b: m.loss(b), fxshard.Mesh(dp=2, ep=2), "no_shard", 1),
    "pp2-dp3-tied": (lambda: GPT2(vocab=64, layers=2), lambda m, b: m(b["idx"], b["tgt"]),
                     fxshard.Mesh(pp=2, dp=3), "optim_grads_params", 2),
}


@pytest.mark.parametrize("case", list(CASES))
def test_pieces_hold_the_global_tensors_and_are_written_once(case):
    make_model, loss, mesh, sharding, microbatches = CASES[case]
    model = make_model()
    batch = {"idx": torch.randint(0, 64, (2 * microbatches, 8)), "tgt": torch.randint(0, 64, (2 * microbatches, 8))}
    config = fxshard.Config(sharding=sharding, microbatches=microbatches)
    stages = [_compile(model, loss, batch, ADAMW, mesh, config, (stage,)) for stage in range(mesh.pp)]
    traced = stages[0][0]
    shapes = global_tensors(traced)
    tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    written = {key: torch.zeros(math.prod(shape), dtype=torch.int) for key, (shape, _) in shapes.items()}
    for rank in range(mesh.size):
        coords = mesh.coords(rank)
        program = stages[coords["pp"]][-1]
        state = initial_state(program, model, ADAMW, coords)
        held = {key: torch.zeros(value.numel(), dtype=torch.int) for key, value in state.items()}
        for piece in state_pieces(program, traced, coords):
            window = slice(piece.start, piece.start + piece.numel)
            held[piece.state][piece.local:piece.local + piece.numel] += 1
            if piece.writes:
                written[piece.key][window] += 1
            if piece.key.startswith("model."):
                name = piece.key[len("model."):]
                local = state[piece.state].view(-1)[piece.local:piece.local + piece.numel]
                assert torch.equal(local, tensors[name].detach().reshape(-1)[window].to(local.dtype)), (case, rank, piece)
        specs = {(spec.kind, spec.name): spec for spec in program.inputs}
        for (kind, name), count in held.items():
            if kind is InputKind.COORD:
                continue
            assert count.max() <= 1, (case, rank, name)  # no element in two pieces
            unit = program.unit_of(specs[kind, name])
            padding = unit.padding if unit is not None else 0
            # every element but the unit's padding (which sits at the end of the last shard) is held
            assert count.numel() - count.sum() <= padding, (case, rank, name, count.sum(), padding)
    for key, count in written.items():
        assert torch.all(count == 1), (case, key, count.unique())
    assert model_key("tok_emb.weight") in written or model_key("wte.weight") in written


def test_a_ranks_own_buffer_copies_are_those_of_the_saved_ranks_at_its_dp_index():
    """Per-rank copies of updated buffers (BatchNorm statistics) follow the data-parallel index, not the
    global rank: the same dp size with other stages or another cut gives each rank the copies of every
    saved stage at its dp index; another dp size none (the first dp rank's model.<name> stays)."""
    from types import SimpleNamespace

    from fxshard.checkpoint.dcp import _own_buffer_keys
    from fxshard.checkpoint.state import buffers_key

    def step(mesh, rank):
        return SimpleNamespace(mesh=mesh, rank=rank, coords=mesh.coords(rank), mesh_description=str(mesh))

    saved_mesh = fxshard.Mesh(pp=2, dp=2)  # ranks 0, 1 stage 0 (dp 0, 1); ranks 2, 3 stage 1
    manifest = {"mesh": str(saved_mesh), "sizes": {"pp": 2, "dp": 2}}
    saved = {buffers_key(r) for r in range(4)}
    for rank in range(4):  # the same mesh (with any cut): both stages' copies at this rank's dp index
        dp = rank % 2
        assert _own_buffer_keys(step(saved_mesh, rank), manifest, saved) == [buffers_key(dp), buffers_key(2 + dp)]
    assert _own_buffer_keys(step(fxshard.Mesh(dp=2), 1), manifest, saved) == [buffers_key(1), buffers_key(3)]
    assert _own_buffer_keys(step(fxshard.Mesh(dp=4), 1), manifest, saved) == []  # another dp size
    # a checkpoint from before `sizes`: its own rank's copy under the same mesh only
    old = {"mesh": str(saved_mesh)}
    assert _own_buffer_keys(step(saved_mesh, 3), old, saved) == [buffers_key(3)]
    assert _own_buffer_keys(step(fxshard.Mesh(dp=2), 1), old, saved) == []
