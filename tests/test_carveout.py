"""The SM-carveout lowering: matmuls inside EP all-to-all windows are bracketed, values unchanged."""

import torch

import fxshard
from fxshard.models import MoEGPT, MoEGPTConfig
from fxshard.passes import run_pipeline
from fxshard.runtime.carveout import carve_out_sms_for_all_to_alls, set_sm_carveout
from fxshard.testing import assert_bit_identical
from strategies import rank_batches

c10d = torch.ops._c10d_functional


def test_carveout_brackets_every_window_and_changes_no_value():
    torch.manual_seed(0)
    model = MoEGPT(MoEGPTConfig.preset("tiny"))
    sgd = fxshard.optim.SGD(lr=0.5)
    mesh, local = fxshard.Mesh(dp=2, ep=2), rank_batches(2, 2)
    config = fxshard.Config(ep_overlap=True, ep_chunks=2, sharding="optim_grads_params")
    program = run_pipeline(fxshard.trace(model, lambda m, b: m.loss_and_metrics(b), local[0], optimizer=sgd,
                                         config=config), mesh, config)[-1]
    lowered, stretches = carve_out_sms_for_all_to_alls(program.graph_module, 20)
    carved, in_flight, seen = None, set(), 0
    for node in lowered.graph.nodes:
        if node.target is set_sm_carveout:
            carved = node.args[0]
            assert (carved is None) == (not in_flight)  # set right after a first issue, cleared after a last wait
            seen += 1
        elif node.target is c10d.all_to_all_single.default:
            in_flight.add(node)
        elif node.target is c10d.wait_tensor.default and node.args[0] in in_flight:
            in_flight.discard(node.args[0])
        elif node.target in (torch.ops.aten.mm.default, torch.ops.fxshard.grouped_mm_wgrad.default):
            assert (carved == 20) == bool(in_flight), node.name  # exactly the matmuls inside windows
    assert stretches > 0 and seen == 2 * stretches and carved is None
    assert_bit_identical([program, program.replace(graph_module=lowered)], model, sgd, mesh, local, steps=1)
    assert torch._C._get_sm_carveout_experimental() is None  # left as found


def test_ep_sm_carveout_is_checked():
    for bad in (-1, 1.5, "16"):
        try:
            fxshard.Config(ep_sm_carveout=bad)
        except fxshard.FxShardError as error:
            assert "ep_sm_carveout" in str(error)
        else:
            raise AssertionError(f"ep_sm_carveout={bad!r} accepted")
