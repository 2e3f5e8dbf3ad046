"""Ranks that would trace the same step share one trace (fxshard/share.py), carried as bytes
(fxshard/program_io.py): every pass maps a loaded program as it maps the traced one, the fingerprint
changes with what the trace reads, and on real processes the ranks that agree trace once.

Every real-process test also runs loaded programs: on gloo, ranks above the lowest of those that agree
train the program they loaded (tests/test_parity_models_gloo.py checks it was loaded)."""

from unittest import mock

import pytest
import torch
import torch.distributed as dist

import fxshard
import fxshard.api as api
from fxshard import program_io
from fxshard.launch import run_local
from fxshard.models import GPT, GPTConfig
from fxshard.share import fingerprint, shared_trace
from fxshard.batch import BatchSpec
from model_zoo import MODELS, masked_batches


class Constants(torch.nn.Module):
    """Tensors made in the forward are constants of the program (get_attr nodes)."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(2)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x) * torch.tensor([1.0, 2.0, 3.0, 4.0])
        return x.square().mean()


MODELS = {**MODELS, "constants": (Constants, lambda m, b: m(b["x"]), False)}
CASES = {  # model, mesh, config: constants in a pipeline's chunks, recognized MoE + EP, a pipeline over ZeRO-3
    "constants-pp2": ("constants", fxshard.Mesh(pp=2), fxshard.Config(microbatches=2)),
    "mixtral-dp2-ep2": ("mixtral", fxshard.Mesh(dp=2, ep=2), fxshard.Config(ep_overlap=True, ep_chunks=2)),
    "titan_deepseek_v3-pp2-dp2": ("titan_deepseek_v3", fxshard.Mesh(pp=2, dp=2), fxshard.Config(microbatches=2)),
}


def assert_same_program(ours, traced):
    assert (ours.name, ours.code) == (traced.name, traced.code)
    assert (ours.inputs, ours.outputs, ours.units, ours.updates, ours.stage, ours.balances) == \
        (traced.inputs, traced.outputs, traced.units, traced.updates, traced.stage, traced.balances)
    assert {k: v for k, v in ours.notes.items() if "seconds" not in k} == \
        {k: v for k, v in traced.notes.items() if "seconds" not in k}
    for node, other in zip(ours.graph.nodes, traced.graph.nodes):
        assert node.meta.keys() == other.meta.keys(), node.name
        if node.op == "get_attr":
            assert torch.equal(getattr(ours.graph_module, node.target), getattr(traced.graph_module, node.target))


@pytest.mark.parametrize("case", list(CASES))
def test_every_pass_maps_a_loaded_program_as_it_maps_the_traced_one(case):
    name, mesh, config = CASES[case]
    model, loss_fn = MODELS[name][0](), MODELS[name][1]
    batch = {"x": torch.randn(4, 4)} if name == "constants" else masked_batches(name, 1, rows=4 // mesh.dp)[0]
    traced, calls = [], []

    def trace(*args, **kwargs):  # traced once (passes are pure); each stage's second compile gets it as bytes read back
        calls.append(args)
        if not traced:
            traced.append(real_trace(*args, **kwargs))
        return traced[0] if len(calls) % 2 else program_io.loads(program_io.dumps(traced[0]))

    real_trace = api._trace
    with mock.patch.object(api, "_trace", trace):
        for stage in range(mesh.pp):
            first = api._compile(model, loss_fn, batch, fxshard.optim.AdamW(), mesh, config, (stage,))
            loaded = api._compile(model, loss_fn, batch, fxshard.optim.AdamW(), mesh, config, (stage,))
            assert len(loaded) == len(first) >= 2  # the traced program and at least one pass's
            for ours, theirs in zip(loaded, first):
                assert_same_program(ours, theirs)


def test_meta_that_does_not_serialize_is_named_and_other_bytes_are_refused():
    batch = {"idx": torch.zeros(2, 8, dtype=torch.long), "tgt": torch.zeros(2, 8, dtype=torch.long)}
    program = fxshard.trace(GPT(GPTConfig.preset("tiny", n_layer=1)), lambda m, b: m.loss(b), batch)
    node = next(iter(program.graph.nodes))
    node.meta["callback"] = lambda: None
    with pytest.raises(TypeError, match="does not serialize"):
        program_io.dumps(program)
    del node.meta["callback"]
    data = program_io.dumps(program)
    stale = data.replace(torch.__version__.encode(), b"0.0.0+old", 1)
    with pytest.raises(ValueError, match="begin b'fxshard-program 1 torch 0.0.0.old"):
        program_io.loads(stale)


def test_the_fingerprint_changes_with_what_the_trace_reads(tmp_path):
    batch = {"idx": torch.zeros(2, 8, dtype=torch.long), "tgt": torch.zeros(2, 8, dtype=torch.long)}

    def digest(model=None, loss_fn=lambda m, b: m.loss(b), rows=2, config=fxshard.Config(),
               optimizer=fxshard.optim.AdamW()):
        torch.manual_seed(0)
        model = model or GPT(GPTConfig.preset("tiny"))
        spec = BatchSpec.from_example({k: v[:rows] for k, v in batch.items()})
        return fingerprint(model, loss_fn, spec, optimizer, config)

    same = digest()
    assert digest() == same  # a second build of the same model
    frozen = GPT(GPTConfig.preset("tiny"))
    frozen.head.weight.requires_grad_(False)
    others = [digest(GPT(GPTConfig.preset("tiny", n_layer=3))), digest(frozen), digest(GPT(GPTConfig.preset("tiny")).eval()),
              digest(loss_fn=lambda m, b: 2 * m.loss(b)), digest(rows=1), digest(config=fxshard.Config(microbatches=2)),
              digest(optimizer=fxshard.optim.AdamW(lr=0.5))]
    assert same not in others and len(set(others)) == len(others)
    assert digest(config=fxshard.Config(verbose=True)) == same  # what the trace does not read
    assert digest(config=fxshard.Config(dump_dir=str(tmp_path / "stage1"))) == same


def ranks_share(digests, failing):
    """On each rank: shared_trace with this rank's digest, counting the traces it ran itself."""
    rank = dist.get_rank()
    batch = {"idx": torch.zeros(2, 8, dtype=torch.long), "tgt": torch.zeros(2, 8, dtype=torch.long)}
    runs = []

    def trace():
        runs.append(rank)
        if rank in failing:
            raise fxshard.FxShardError(f"rank {rank} cannot trace")
        return fxshard.trace(GPT(GPTConfig.preset("tiny", n_layer=1)), lambda m, b: m.loss(b), batch)

    try:
        program = shared_trace(trace, digests[rank])
    except fxshard.FxShardError as error:
        return {"traced": len(runs), "error": str(error)}
    return {"traced": len(runs), "code": program.code, "by": program.notes.get("trace_shared_by")}


def test_ranks_that_agree_trace_once_and_a_failed_trace_fails_every_rank_with_its_own_error():
    agree = run_local(ranks_share, 3, ["a", "a", "b"], (), backend="gloo")
    assert [r["traced"] for r in agree] == [1, 0, 1]  # rank 2's digest is its own
    assert [r["by"] for r in agree] == [None, 0, None]
    assert agree[0]["code"] == agree[1]["code"] == agree[2]["code"]
    failed = run_local(ranks_share, 3, ["a", "a", "a"], (0,), backend="gloo")
    # rank 0 fails: the others are told and trace themselves, so each fails, or succeeds, on its own
    assert [r["traced"] for r in failed] == [1, 1, 1]
    assert failed[0]["error"] == "rank 0 cannot trace" and "error" not in failed[1] and "error" not in failed[2]
