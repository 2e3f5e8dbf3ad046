"""The copy-engine all-to-all lowering (fxshard/runtime/copy_engine.py): which nodes it rewrites. What
the copies compute is checked on GPUs (tests/test_gpu.py: bit-identical to NCCL, eager and graphed)."""

import pytest
import torch
import torch.fx as fx

import fxshard
from fxshard import meta
from fxshard.models import MoEGPT, MoEGPTConfig
from fxshard.passes import run_pipeline
from fxshard.runtime.copy_engine import copy_engine_all_to_all, lower_all_to_alls_to_copy_engines
from strategies import rank_batches

c10d = torch.ops._c10d_functional


def test_every_ep_all_to_all_and_nothing_else_is_lowered():
    torch.manual_seed(0)
    model = MoEGPT(MoEGPTConfig.preset("tiny", capacity_factor=1.0))
    mesh, local = fxshard.Mesh(dp=2, ep=2), rank_batches(2, 2)
    config = fxshard.Config(ep_overlap=True, microbatches=2, ep_interleave="dual-batch")
    program = run_pipeline(fxshard.trace(model, lambda m, b: m.loss_and_metrics(b), local[0],
                                         optimizer=fxshard.optim.SGD(lr=0.1), config=config), mesh, config)[-1]
    before = [n for n in program.graph.nodes if meta.is_moe_all_to_all(n)]
    others = [n.name for n in program.graph.nodes if n.op == "call_function" and n.target in
              (c10d.all_gather_into_tensor.default, c10d.reduce_scatter_tensor.default, c10d.all_reduce.default)]
    lowered, count = lower_all_to_alls_to_copy_engines(program.graph_module)
    assert count == len(before) > 0
    nodes = {n.name: n for n in lowered.graph.nodes}
    spans = []
    for node in before:
        new = nodes[node.name]
        assert new.target is copy_engine_all_to_all
        assert new.args[0] is nodes[node.args[0].name] and new.args[1:4] == node.args[1:4]
        value = node.args[0].meta["val"]
        region, total = new.args[4:6]
        assert region % 256 == 0 and region + value.numel() * value.element_size() <= total
        spans.append((region, region + value.numel() * value.element_size()))
        assert [u.target for u in new.users] == [c10d.wait_tensor.default]  # still waited where it was
    spans.sort()
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))  # regions never overlap
    for name in others:
        assert nodes[name].target is not copy_engine_all_to_all
    assert all(not meta.is_moe_all_to_all(n) for n in lowered.graph.nodes)


def test_all_to_alls_with_unequal_splits_keep_nccl():
    graph = fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = torch.empty(6, 4)
    for splits in ([2, 4], [3, 3]):
        node = graph.call_function(c10d.all_to_all_single.default, (x, splits, splits, "0"))
        node.meta[meta.MOE_PIECE] = "dispatch"
        node.meta[meta.COMM_BYTES] = 6 * 4 * 4
        graph.call_function(c10d.wait_tensor.default, (node,))
    graph.output(None)
    lowered, count = lower_all_to_alls_to_copy_engines(fx.GraphModule(torch.nn.Module(), graph))
    assert count == 1
    assert [n.args[1] for n in lowered.graph.nodes if n.target is copy_engine_all_to_all] == [[3, 3]]


def test_ep_all_to_all_is_checked():
    with pytest.raises(fxshard.FxShardError, match="ep_all_to_all"):
        fxshard.Config(ep_all_to_all="nvshmem")
    assert fxshard.Config(ep_all_to_all="copy-engine").ep_all_to_all == "copy-engine"


def test_a_workspace_that_cannot_be_set_up_says_why_and_what_to_do(monkeypatch):
    from torch.distributed import _symmetric_memory as symm

    from fxshard.runtime import copy_engine

    def no_peer_access(*args, **kwargs):
        raise RuntimeError("CUDA driver error: peer access is not supported between these two devices")

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(symm, "enable_symm_mem_for_group", lambda name: None)
    monkeypatch.setattr(symm, "empty", no_peer_access)
    with pytest.raises(fxshard.FxShardError, match="peer access is not supported.*use ep_all_to_all='nccl'"):
        copy_engine._workspace("ep_group", 2 ** 30)
    assert "ep_group" not in copy_engine._WORKSPACES
