"""The SM-carveout lowering: matmuls inside EP all-to-all windows are bracketed, values unchanged."""

import math

import torch

import fxshard
from fxshard import meta
from fxshard.models import MoEGPT, MoEGPTConfig
from fxshard.passes import run_pipeline
from fxshard.runtime.carveout import carve_out_sms_for_all_to_alls, set_sm_carveout
from fxshard.testing import assert_bit_identical
from strategies import rank_batches

c10d = torch.ops._c10d_functional
MATMULS = {torch.ops.aten.mm.default, torch.ops.fxshard.grouped_mm.default, torch.ops.fxshard.grouped_mm_wgrad.default}


def ep_program():
    torch.manual_seed(0)
    model = MoEGPT(MoEGPTConfig.preset("tiny"))
    sgd = fxshard.optim.SGD(lr=0.5)
    mesh, local = fxshard.Mesh(dp=2, ep=2), rank_batches(2, 2)
    config = fxshard.Config(ep_overlap=True, ep_chunks=2, sharding="optim_grads_params")
    program = run_pipeline(fxshard.trace(model, lambda m, b: m.loss_and_metrics(b), local[0], optimizer=sgd,
                                         config=config), mesh, config)[-1]
    return model, sgd, mesh, local, program


def carved_matmuls(lowered):
    """(name, carveout in force, inside a window, first matmul since an issue) for every matmul."""
    carved, in_flight, fresh, rows = None, set(), False, []
    for node in lowered.graph.nodes:
        if node.target is set_sm_carveout:
            carved = node.args[0]
        elif meta.is_moe_all_to_all(node):
            in_flight.add(node)
            fresh = True
        elif node.target is c10d.wait_tensor.default:
            in_flight.discard(node.args[0])
        elif node.target in MATMULS:
            rows.append((node.name, carved, bool(in_flight), fresh and bool(in_flight)))
            fresh = False
    assert carved is None  # cleared by the end
    return rows


def test_carveout_covers_the_matmuls_next_to_each_transfer_and_changes_no_value():
    model, sgd, mesh, local, program = ep_program()
    everywhere, stretches = carve_out_sms_for_all_to_alls(program.graph_module, 20, flops_per_byte=math.inf)
    assert stretches > 0
    for name, carved, inside, _ in carved_matmuls(everywhere):  # every matmul inside a window, no other
        assert (carved == 20) == inside, name
    lowered, _ = carve_out_sms_for_all_to_alls(program.graph_module, 20)
    rows = carved_matmuls(lowered)
    for name, carved, inside, first in rows:
        assert inside or carved is None, name  # never outside a window
        assert carved == 20 or not first, name  # the first matmul after an issue: the transfer is on
    small, _ = carve_out_sms_for_all_to_alls(program.graph_module, 20, flops_per_byte=1e-6)
    rows = carved_matmuls(small)  # a budget smaller than any matmul: exactly the first one after issues
    assert [carved == 20 for _, carved, _, _ in rows] == [first for _, _, _, first in rows]
    assert any(inside and not first for _, _, inside, first in rows)  # so the budget did leave some out
    nothing, stretches = carve_out_sms_for_all_to_alls(program.graph_module, 20, flops_per_byte=0)
    assert stretches == 0 and not any(n.target is set_sm_carveout for n in nothing.graph.nodes)
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
