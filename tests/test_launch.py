"""Ranks and their process groups. fxshard.launch.run_local: each rank runs with its rank, the world size
and the caller's environment as it is at the call (ranks fork from a server process that started
earlier, with an older one). fxshard.shard: the process groups of a mesh are made once per process."""

import os

import pytest
import torch
import torch.distributed as dist

import fxshard
from fxshard.launch import run_local


def _what_a_rank_sees():
    try:  # no mesh in a job of several ranks: each would train its own copy (and a save would mix them)
        fxshard.shard(torch.nn.Linear(2, 1), lambda m, b: m(b["x"]).sum(), {"x": torch.randn(2, 2)})
        refused = None
    except fxshard.FxShardError as error:
        refused = str(error)
    if dist.get_world_size() > 1:
        assert refused.startswith("shard() was given no mesh, in a process group of 2 ranks") and \
            "mesh=fxshard.Mesh(dp=2)" in refused, refused
    else:
        assert refused is None, refused
    return dist.get_rank(), dist.get_world_size(), os.environ.get("FXSHARD_TEST_LAUNCH")


def test_each_rank_sees_the_callers_environment_at_the_call(monkeypatch):
    monkeypatch.setenv("FXSHARD_TEST_LAUNCH", "first")
    assert run_local(_what_a_rank_sees, 2) == [(0, 2, "first"), (1, 2, "first")]
    monkeypatch.setenv("FXSHARD_TEST_LAUNCH", "second")  # changed after the server started
    assert run_local(_what_a_rank_sees, 2) == [(0, 2, "second"), (1, 2, "second")]
    monkeypatch.delenv("FXSHARD_TEST_LAUNCH")
    assert run_local(_what_a_rank_sees, 1) == [(0, 1, None)]


def _rank_one_fails():
    if dist.get_rank() == 1:
        raise ValueError("rank one's own error")
    return dist.get_rank()


def test_a_failing_rank_says_why_before_its_groups_are_torn_down(capfd, monkeypatch):
    """Tearing a rank's groups down can wait forever on a peer still inside a collective (NCCL), and
    the error would then never reach run_local: the rank prints it first. (run_local may raise the
    peer's error instead, "connection reset": then only this print names the cause.)"""
    monkeypatch.setenv("FXSHARD_START_METHOD", "spawn")  # a forkserver's ranks write to its stderr, not capfd's
    with pytest.raises(Exception):
        run_local(_rank_one_fails, 2, backend="gloo")
    err = capfd.readouterr().err
    assert "fxshard: rank 1 failed:" in err and "ValueError: rank one's own error" in err.split("rank 1 failed:")[1]


def _rank_one_refuses():
    if dist.get_rank() == 1:
        raise fxshard.FxShardError("the cause; the fix")
    return dist.get_rank()


def test_a_ranks_fxshard_error_reaches_the_caller_as_one(capfd):
    """An error the user can mend, raised in a rank, is raised by run_local as FxShardError naming the
    rank (a launcher prints one line), not as torch.multiprocessing's page of tracebacks."""
    with pytest.raises(fxshard.FxShardError, match=r"^rank 1: the cause; the fix$"):
        run_local(_rank_one_refuses, 2, backend="gloo")


def test_ranks_fork_from_the_server_only_for_gloo_without_cuda(monkeypatch):
    """A process forked after CUDA was asked anything cannot use CUDA: NCCL ranks, and any rank on a
    machine with a GPU, start as fresh interpreters."""
    from fxshard.launch import _start_method

    monkeypatch.delenv("FXSHARD_START_METHOD", raising=False)
    assert _start_method("nccl") == "spawn"
    assert _start_method("gloo") == ("spawn" if torch.cuda.is_available() else "forkserver")
    monkeypatch.setenv("FXSHARD_START_METHOD", "spawn")
    assert _start_method("gloo") == "spawn"
    monkeypatch.setenv("FXSHARD_START_METHOD", "fork-please")
    with pytest.raises(fxshard.FxShardError, match="FXSHARD_START_METHOD='fork-please' is not a start method"):
        _start_method("gloo")


def _two_steps_on_one_mesh():
    """Two steps of the same model and batches, sharded one after the other on Mesh(dp=2), stepped
    alternately (the second asks for Config(nccl_max_ctas), which gloo ignores); a third with another
    collective timeout."""
    from strategies import MLPStack, mse, regression_batch

    generator = torch.Generator().manual_seed(dist.get_rank())
    batches = [regression_batch(generator, 4) for _ in range(3)]
    steps = []
    for timeout_s, max_ctas in ((600.0, None), (600.0, 8), (300.0, None)):
        torch.manual_seed(0)
        config = fxshard.Config(collective_timeout_s=timeout_s, nccl_max_ctas=max_ctas)
        steps.append(fxshard.shard(MLPStack([4, 8, 4]), mse, batches[0], optimizer=fxshard.optim.AdamW(lr=1e-2),
                                   mesh=fxshard.Mesh(dp=2), config=config))
    first, second, third = steps
    losses = [[float(step(batch)["loss"]) for step in (first, second)] for batch in batches]
    return first.groups["dp"] is second.groups["dp"], first.groups["dp"] is third.groups["dp"], losses


def test_shard_reuses_its_process_groups_and_steps_on_them_stay_apart():
    """Each shard() on a mesh reused to make new process groups (NCCL communicators, copy-engine
    workspaces) that were never freed; now a later call reuses the groups of an earlier one with the
    same timeout, and two steps stepped alternately on them compute what each computes alone."""
    for shared, shared_with_other_timeout, losses in run_local(_two_steps_on_one_mesh, 2):
        assert shared and not shared_with_other_timeout
        assert all(a == b for a, b in losses), losses
        assert losses[-1][0] < losses[0][0]  # it trains


def test_a_function_the_ranks_cannot_import_is_refused_before_any_process_starts():
    def nested():
        return 1

    for fn in (nested, lambda: 1):
        with pytest.raises(fxshard.FxShardError, match="needs a function the ranks can import"):
            run_local(fn, 2, backend="gloo")
