"""fxshard.launch.run_local: each rank runs with its rank, the world size and the caller's environment
as it is at the call (ranks fork from a server process that started earlier, with an older one)."""

import os

import torch
import torch.distributed as dist

from fxshard.launch import run_local


def _what_a_rank_sees():
    return dist.get_rank(), dist.get_world_size(), os.environ.get("FXSHARD_TEST_LAUNCH")


def test_each_rank_sees_the_callers_environment_at_the_call(monkeypatch):
    monkeypatch.setenv("FXSHARD_TEST_LAUNCH", "first")
    assert run_local(_what_a_rank_sees, 2) == [(0, 2, "first"), (1, 2, "first")]
    monkeypatch.setenv("FXSHARD_TEST_LAUNCH", "second")  # changed after the server started
    assert run_local(_what_a_rank_sees, 2) == [(0, 2, "second"), (1, 2, "second")]
    monkeypatch.delenv("FXSHARD_TEST_LAUNCH")
    assert run_local(_what_a_rank_sees, 1) == [(0, 1, None)]


def test_ranks_fork_from_the_server_only_for_gloo_without_cuda(monkeypatch):
    """A process forked after CUDA was asked anything cannot use CUDA: NCCL ranks, and any rank on a
    machine with a GPU, start as fresh interpreters."""
    from fxshard.launch import _start_method

    monkeypatch.delenv("FXSHARD_START_METHOD", raising=False)
    assert _start_method("nccl") == "spawn"
    assert _start_method("gloo") == ("spawn" if torch.cuda.is_available() else "forkserver")
    monkeypatch.setenv("FXSHARD_START_METHOD", "spawn")
    assert _start_method("gloo") == "spawn"
