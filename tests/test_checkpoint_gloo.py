"""Checkpoints on real processes (gloo): resume is exact, and a checkpoint written under one layout
(mesh, sharding strategy, pipeline cut, ep size) loads under any other.

A saver job trains 10 steps and saves after step 5; a loader job (new processes, maybe another
layout) loads that and trains steps 6-10. Same layout: the loader's losses equal the saver's bit for
bit. Across layouts: within 1e-6 relative (the layouts sum in other orders).

CI runs a few pairs; `FXSHARD_CHECKPOINT_MATRIX=all pytest tests/test_checkpoint_gloo.py -k matrix -s`
runs all 25 and prints the table (recorded in bench/RESULTS.md).
"""

import os
import shutil

import pytest
import torch
import torch.distributed as dist

import fxshard
from fxshard.launch import run_local
from fxshard.models import MoEGPT, MoEGPTConfig

ADAMW = fxshard.optim.AdamW(lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1, no_decay=("*norm.weight",))  # :no_decay units too
STEPS, SAVE_AT, ROWS, SEQ = 10, 5, 8, 16
# name -> (processes, Mesh arguments or None for one device, sharding, microbatches)
LAYOUTS = {
    "one": (1, None, "no_shard", 1),
    "dp2-zero1": (2, dict(dp=2), "optim", 1),
    "dp4-zero3": (4, dict(dp=4), "optim_grads_params", 1),
    "pp2dp2": (4, dict(pp=2, dp=2), "optim", 2),
    "dp4ep2": (4, dict(dp=4, ep=2), "optim_grads_params", 1),
}


def model():
    # no load-balancing loss: it is a function of each rank's own tokens, so it would differ by layout
    torch.manual_seed(0)
    moe = MoEGPT(MoEGPTConfig.preset("tiny", aux_loss_coef=0.0))
    # a buffer the forward never reads (transformers' rotary_emb.original_inv_freq): no pipeline stage
    # holds it, so the pipeline's checkpoint lacks it, and it loads anywhere all the same
    moe.register_buffer("unread", torch.arange(3.0))
    return moe


def batches():
    generator = torch.Generator().manual_seed(0)
    return [{"idx": torch.randint(0, 64, (ROWS, SEQ), generator=generator),
             "tgt": torch.randint(0, 64, (ROWS, SEQ), generator=generator)} for _ in range(STEPS)]


def shard(layout: str):
    """This rank's step under `layout`, and its part of every batch."""
    _, mesh_args, sharding, microbatches = LAYOUTS[layout]
    mesh = fxshard.Mesh(**mesh_args) if mesh_args else None
    dp, index = (mesh.dp, mesh.coords(dist.get_rank())["dp"]) if mesh else (1, 0)
    rows = ROWS // dp
    local = [{k: v[index * rows:(index + 1) * rows] for k, v in b.items()} for b in batches()]
    step = fxshard.shard(model(), lambda m, b: m.loss(b), local[0], ADAMW, mesh=mesh,
                         config=fxshard.Config(sharding=sharding, microbatches=microbatches))
    return step, local


def save_job(layout: str, directory: str) -> list[float]:
    step, local = shard(layout)
    losses = []
    for number, batch in enumerate(local, 1):
        losses.append(step(batch)["loss"].item())
        if number == SAVE_AT:
            fxshard.save(step, os.path.join(directory, layout), extra={"next_batch": number})
    return losses


def load_job(saved: list[str], layout: str, directory: str) -> list[list[float]]:
    """For each saved layout: load its checkpoint into one fresh step of this layout, train the rest."""
    step, local = shard(layout)
    result = []
    for source in saved:
        extra = fxshard.load(step, os.path.join(directory, source))
        assert extra == {"next_batch": SAVE_AT} and step.step_count == SAVE_AT
        result.append([step(batch)["loss"].item() for batch in local[SAVE_AT:]])
    return result


def resume_table(savers: list[str], loaders: list[str], root: str) -> dict:
    """(saver, loader) -> (uninterrupted losses of steps 6-10 under the saver, resumed under the loader)."""
    saved = {}
    for layout in savers:
        saved[layout] = run_local(save_job, LAYOUTS[layout][0], layout, root, backend="gloo")[0]
    table = {}
    for layout in loaders:
        resumed = run_local(load_job, LAYOUTS[layout][0], savers, layout, root, backend="gloo")[0]
        for source, losses in zip(savers, resumed):
            table[source, layout] = (saved[source][SAVE_AT:], losses)
    return table


def check(table: dict) -> None:
    for (source, target), (uninterrupted, resumed) in table.items():
        if source == target:
            assert resumed == uninterrupted, (source, target, uninterrupted, resumed)
        worst = max(abs(a - b) / abs(a) for a, b in zip(uninterrupted, resumed))
        assert worst < 1e-6, (source, target, worst, uninterrupted, resumed)


def damaged_load_job(path: str, layout: str) -> str:
    step, _ = shard(layout)
    with pytest.raises(fxshard.FxShardError) as raised:
        fxshard.load(step, path)
    return str(raised.value)


def test_resume_is_exact_on_the_same_layout_and_across_layouts(tmp_path):
    # ZeRO-1 over 2 ranks and pipeline x data parallel, each into itself (bit for bit) and into the other
    check(resume_table(["dp2-zero1", "pp2dp2"], ["dp2-zero1", "pp2dp2"], str(tmp_path)))
    # a flipped bit in the file only rank 1 checksums: both ranks refuse it, rank 0 naming rank 1
    damaged = tmp_path / "damaged"
    shutil.copytree(tmp_path / "dp2-zero1", damaged)
    name = sorted(f for f in os.listdir(damaged) if f.endswith(".distcp"))[1]  # every rank checks .metadata
    with open(damaged / name, "r+b") as handle:
        handle.seek(os.path.getsize(damaged / name) // 2)
        byte = handle.read(1)[0]
        handle.seek(-1, os.SEEK_CUR)
        handle.write(bytes([byte ^ 0x10]))
    said = run_local(damaged_load_job, 2, str(damaged), "dp2-zero1", backend="gloo")
    assert f"{name} is not the file the save wrote" in said[1] and "rank 1 could not load" in said[0], said


@pytest.mark.skipif(os.environ.get("FXSHARD_CHECKPOINT_MATRIX") != "all",
                    reason="the full 5 x 5 table: FXSHARD_CHECKPOINT_MATRIX=all")
def test_resume_matrix_every_layout_into_every_layout(tmp_path):
    table = resume_table(list(LAYOUTS), list(LAYOUTS), str(tmp_path))
    print(f"\n{'saved under':>12} {'loaded under':>12}  max relative loss difference, steps 6-10")
    for (source, target), (uninterrupted, resumed) in table.items():
        worst = max(abs(a - b) / abs(a) for a, b in zip(uninterrupted, resumed))
        print(f"{source:>12} {target:>12}  {worst:.2e}{'  (bit for bit)' if resumed == uninterrupted else ''}")
    check(table)


def glu_model(**overrides):
    torch.manual_seed(0)
    return MoEGPT(MoEGPTConfig.preset("tiny", **{"glu_interleave_size": 2, **overrides}))


def glu_job(directory: str, phase: str) -> None:
    """ZeRO-3 shards of a GLU-interleaved expert fc1 (unit shards end inside parameters): phase
    "train" trains 3 steps on 2 ranks and saves; phase "reshard" loads that on 3 ranks into the same
    layout and into indexed, plain-row expert weights, and saves each back; returns the warnings about
    random state the checkpoint lacks (rank 2's: the saving job had two ranks)."""
    rank = dist.get_rank()
    batch = {k: v[rank * 2:(rank + 1) * 2] for k, v in batches()[0].items()}
    config = fxshard.Config(sharding="optim_grads_params")
    mesh = fxshard.Mesh(dp=dist.get_world_size())
    if phase == "train":
        step = fxshard.shard(glu_model(), lambda m, b: m.loss(b), batch, ADAMW, mesh=mesh, config=config)
        for _ in range(3):
            step(batch)
        fxshard.save(step, os.path.join(directory, "two_ranks"))
        return []
    import warnings

    lacking = []
    for name, overrides in (("same_layout", {}), ("indexed_plain", dict(expert_weights="indexed",
                                                                         glu_interleave_size=None))):
        step = fxshard.shard(glu_model(**overrides), lambda m, b: m.loss(b), batch, ADAMW, mesh=mesh, config=config)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fxshard.load(step, os.path.join(directory, "two_ranks"))
        lacking += [str(w.message) for w in caught if "holds no random state" in str(w.message)]
        fxshard.save(step, os.path.join(directory, name))
    return lacking


def test_glu_interleaved_experts_reshard_2_to_3_ranks_with_both_adam_moments_exact(tmp_path):
    from fxshard.checkpoint import ExpertLayout, convert_expert_tensors, read_tensors

    run_local(glu_job, 2, str(tmp_path), "train", backend="gloo")
    lacking = run_local(glu_job, 3, str(tmp_path), "reshard", backend="gloo")
    assert [len(messages) for messages in lacking] == [0, 0, 2]  # rank 2 keeps its own, and is told so
    assert "for rank 2 (the saving job had fewer ranks)" in lacking[2][0]
    saved = read_tensors(tmp_path / "two_ranks")
    assert any(key.endswith("exp_avg_sq") for key in saved) and saved["optim.tok_emb.weight.exp_avg"].abs().sum() > 0
    same = read_tensors(tmp_path / "same_layout")
    assert saved.keys() == same.keys()
    for key in saved:
        assert torch.equal(saved[key], same[key]), key
    # the interleaved fc1 of each layer, its weight and both moments, converted in global coordinates
    indexed = read_tensors(tmp_path / "indexed_plain")
    source, target = ExpertLayout("grouped", 2), ExpertLayout("indexed", None)
    fc1 = [key[len("model."):-len("weight")] for key in saved if key.endswith("experts.fc1.weight")]
    assert len(fc1) == 2
    for prefix in fc1:
        for kind, suffix in (("model.", ""), ("optim.", ".exp_avg"), ("optim.", ".exp_avg_sq")):
            converted = convert_expert_tensors({"weight": saved[f"{kind}{prefix}weight{suffix}"]}, source, target, 4)
            for rel, value in converted.items():
                assert torch.equal(indexed[f"{kind}{prefix}{rel}{suffix}"], value), (prefix, rel, suffix)


def raw_dcp_job(directory: str) -> bool:
    """step.state_dict() with DCP's own save and load (fxshard's planners), parameters replicated
    over dp (ZeRO-1): every replica gets the values back, though only one of them wrote them."""
    import torch.distributed.checkpoint as dcp

    from fxshard.checkpoint import LoadPlanner, SavePlanner

    step, local = shard("dp2-zero1")
    for batch in local[:2]:
        step(batch)
    dcp.save(step.state_dict(), checkpoint_id=directory, planner=SavePlanner())
    saved = step.parameters()
    fresh, _ = shard("dp2-zero1")
    state = fresh.state_dict()
    dcp.load(state, checkpoint_id=directory, planner=LoadPlanner())
    fresh.load_state_dict(state)
    loaded = fresh.parameters()
    return fresh.step_count == 2 and all(torch.equal(saved[n], loaded[n]) for n in saved)


def test_step_state_dict_round_trips_through_dcp_on_every_replica(tmp_path):
    assert run_local(raw_dcp_job, 2, str(tmp_path / "raw"), backend="gloo") == [True, True]


class _Counting(torch.nn.Module):
    """A buffer the forward updates from this rank's own batch: the dp ranks' copies differ."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 16), torch.nn.Linear(16, 1)
        self.register_buffer("seen", torch.zeros(16))

    def forward(self, x):
        h = torch.relu(self.a(x))
        with torch.no_grad():
            self.seen.add_(h.mean(0))
        return self.b(h + 0.1 * self.seen)


def own_buffers_job(directory: str):
    """Each rank's updated buffer resumes as that rank had it; a failure of rank 0's part of a save
    (its manifest and swap), and a checkpoint only rank 1 cannot find, reach every rank as an
    FxShardError instead of leaving the others waiting in DCP's collectives."""
    from fxshard.checkpoint import dcp as dcp_module

    rank = dist.get_rank()
    generator = torch.Generator().manual_seed(0)
    data = [{"x": torch.randn(8, 8, generator=generator), "y": torch.randn(8, 1, generator=generator)}
            for _ in range(5)]
    local = [{k: v[rank * 4:(rank + 1) * 4] for k, v in b.items()} for b in data]

    def loss(model, batch):
        return ((model(batch["x"]) - batch["y"]) ** 2).mean()

    def shard():
        torch.manual_seed(0)
        return fxshard.shard(_Counting(), loss, local[0], fxshard.optim.AdamW(lr=1e-2), mesh=fxshard.Mesh(dp=2))
    step = shard()
    for batch in local[:3]:
        step(batch)
    fxshard.save(step, os.path.join(directory, "ck"))
    want = [step(batch)["loss"].item() for batch in local[3:]]
    resumed = shard()
    fxshard.load(resumed, os.path.join(directory, "ck"))
    got = [resumed(batch)["loss"].item() for batch in local[3:]]
    try:  # "resume if there is a checkpoint" where one rank's path is wrong: both start fresh
        fxshard.load(resumed, os.path.join(directory, "ck" if rank == 0 else "nowhere"))
        missing = None
    except fxshard.FxShardError as raised:
        missing = str(raised)
    fxshard.save(step, os.path.join(directory, "ck_later"))  # each rank its own "latest": refused, not mixed
    try:
        fxshard.load(resumed, os.path.join(directory, "ck" if rank == 0 else "ck_later"))
        mixed = None
    except fxshard.FxShardError as raised:
        mixed = str(raised)

    def swap_fails(staging, path):
        raise OSError(28, "No space left on device")
    if rank == 0:
        dcp_module._swap_in = swap_fails
    try:
        fxshard.save(step, os.path.join(directory, "ck2"))
        error = None
    except fxshard.FxShardError as raised:
        error = str(raised)
    return got == want, error, missing, mixed


def test_own_buffers_resume_per_rank_and_a_failed_swap_on_rank_0_fails_every_rank(tmp_path):
    for rank, (exact, error, missing, mixed) in enumerate(run_local(own_buffers_job, 2, str(tmp_path), backend="gloo")):
        assert exact
        assert mixed is not None and mixed.startswith("the ranks were given different checkpoints: rank 0 loads ") \
            and "(step 3), rank 1 " in mixed and "ck_later (step 5)" in mixed, mixed
        assert missing.startswith("rank 1 could not load" if rank == 0 else "no checkpoint at"), missing
        assert error is not None and "rank 0 could not put the written checkpoint in place (OSError: " in error
