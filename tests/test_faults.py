"""Fault injection on gloo, real processes, every test bounded in time: a NaN batch on one rank (every
rank skips the step, or every rank raises naming it), a rank that dies inside a step (its peers fail
within seconds naming the collective they waited in). The stalled peer and ranks that compiled
different programs are in test_agreement.py."""

import time

import torch
import torch.distributed as dist

import fxshard
from fxshard.launch import run_local
from fxshard.models import GPT, GPTConfig
from test_nonfinite import ADAMW, Regressor, poisoned, regression_batches, regression_loss


def nan_on_rank_one():
    """dp=2, ZeRO-3: rank 1's second batch holds a NaN. "skip": both ranks skip it and end where a run
    without it ends; "raise": both raise the same error two calls later."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    model, mesh = Regressor(), fxshard.Mesh(dp=2)
    batches = regression_batches(3, seed=rank)
    bad = poisoned(batches[1]) if rank == 1 else batches[1]

    def shard(mode):
        return fxshard.shard(model, regression_loss, batches[0], optimizer=ADAMW, mesh=mesh,
                             config=fxshard.Config(nonfinite=mode))

    skipping, reference = shard("skip"), shard("skip")
    skipped = [bool(skipping(batch)["skipped"]) for batch in (batches[0], bad, batches[1], batches[2])]
    for batch in batches:
        reference(batch)
    expected = reference.parameters()
    same = all(torch.equal(value, expected[name]) for name, value in skipping.parameters().items())
    raising = shard("raise")
    raising(batches[0])
    raising(bad)
    raising(batches[1])
    try:
        raising(batches[2])  # checks step 2: a call reads the flag of the step before the last
        message = None
    except fxshard.FxShardError as error:
        message = str(error)
    # a batch whose compute fails on a mesh (here on both ranks alike, before any collective): unlike one
    # device, the step takes no further call, as peers may wait in the failed call's collectives
    tokens = {"idx": torch.randint(0, 64, (2, 8)), "tgt": torch.randint(0, 64, (2, 8))}
    gpt = fxshard.shard(GPT(GPTConfig.preset("tiny")), lambda m, b: m.loss(b), tokens, mesh=mesh,
                        config=fxshard.Config(sharding="no_shard"))
    said = []
    for call in (lambda: gpt({**tokens, "idx": tokens["idx"] + 64}), lambda: gpt(tokens),
                 lambda: gpt.load_state_dict({})):  # a load too: its collectives would pair with a stuck peer's
        try:
            call()
        except fxshard.FxShardError as error:
            said.append(str(error))
    return skipped, same, message, said


def test_a_nan_on_one_rank_is_skipped_or_raised_on_every_rank():
    results = run_local(nan_on_rank_one, 2, backend="gloo")
    for skipped, same, _, said in results:
        assert skipped == [False, True, False, False] and same
        assert len(said) == 3 and "raised IndexError" in said[0] and "restart the job" in said[0], said
        assert said[1] == said[2] and said[1].startswith("step 1 failed on this rank (IndexError: index out of "
                                                         "range in self) while its peers may wait"), said[1:]
    messages = [message for _, _, message, _ in results]
    assert messages[0] == messages[1] and messages[0].startswith(
        "step 2: the gradients are not finite (grad norm nan); the first parameter whose gradient is not finite "
        "is in FSDP unit 'layers.0' (layers.0.weight, layers.0.bias), in its shard on rank 0"), messages


def dies_in_step_two():
    """Rank 1 leaves the job (its process group closed, as a crashed process's is) before step 2."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    batch = regression_batches(1, seed=rank)[0]
    step = fxshard.shard(Regressor(), regression_loss, batch, optimizer=ADAMW, mesh=fxshard.Mesh(dp=2),
                         config=fxshard.Config(collective_timeout_s=10))
    step(batch)
    if rank == 1:
        dist.destroy_process_group()
        return None, 0.0
    started = time.perf_counter()
    try:
        step(batch)
        outcome = None
    except fxshard.FxShardError as error:
        outcome = str(error)
    dist.destroy_process_group()
    return outcome, time.perf_counter() - started


def test_a_rank_that_dies_ends_its_peers_step_with_the_collective_named():
    (message, seconds), _ = run_local(dies_in_step_two, 2, backend="gloo")
    assert message is not None and seconds < 10, (message, seconds)
    assert message.startswith("step 2: waiting for the all_gather_into_tensor of (") and \
        "on group 'dp' failed" in message, message
