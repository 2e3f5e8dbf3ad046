"""The SM-carveout lowering: matmuls inside the windows of NCCL transfers (EP all-to-alls, collectives,
pipeline point-to-point) are bracketed, values unchanged."""

import collections
import math

import torch

import fxshard
from fxshard import meta
from fxshard.models import MoEGPT, MoEGPTConfig
from fxshard.passes import run_pipeline
from fxshard.runtime.carveout import carve_out_sms, set_sm_carveout
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


def model_loss(model, batch):
    return model.loss(batch)


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
    everywhere, stretches = carve_out_sms(program.graph_module, {"ep": 20}, flops_per_byte=math.inf)
    assert stretches > 0
    for name, carved, inside, _ in carved_matmuls(everywhere):  # every matmul inside a window, no other
        assert (carved == 20) == inside, name
    lowered, _ = carve_out_sms(program.graph_module, {"ep": 20})
    rows = carved_matmuls(lowered)
    for name, carved, inside, first in rows:
        assert inside or carved is None, name  # never outside a window
        assert carved == 20 or not first, name  # the first matmul after an issue: the transfer is on
    small, _ = carve_out_sms(program.graph_module, {"ep": 20}, flops_per_byte=1e-6)
    rows = carved_matmuls(small)  # a budget smaller than any matmul: exactly the first one after issues
    assert [carved == 20 for _, carved, _, _ in rows] == [first for _, _, _, first in rows]
    assert any(inside and not first for _, _, inside, first in rows)  # so the budget did leave some out
    nothing, stretches = carve_out_sms(program.graph_module, {"ep": 20}, flops_per_byte=0)
    assert stretches == 0 and not any(n.target is set_sm_carveout for n in nothing.graph.nodes)
    assert_bit_identical([program, program.replace(graph_module=lowered)], model, sgd, mesh, local, steps=1)
    assert torch._C._get_sm_carveout_experimental() is None  # left as found


def test_pipeline_matmuls_next_to_a_posted_receive_or_a_collective_leave_the_larger_carveout():
    """pp=2 x dp=2 ZeRO-3 (GPT, four blocks, 1F1B): with every window's budget unbounded, each matmul
    runs with the largest carveout of the transfers in flight at it (a receive's from its issue to its
    wait, a collective's likewise), none outside; with the default budgets a receive still covers its
    whole window; and the stage programs still train like one device."""
    from fxshard.models import GPT, GPTConfig
    from fxshard.runtime.carveout import transfer_kind
    from fxshard.testing import assert_step_like_eager

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=40, d_model=16, n_layer=4, n_head=2, d_ff=24))
    generator = torch.Generator().manual_seed(1)
    pieces = [{"idx": torch.randint(0, 40, (2, 8), generator=generator),
               "tgt": torch.randint(0, 40, (2, 8), generator=generator)} for _ in range(8)]
    optimizer = fxshard.optim.AdamW(lr=1e-3)
    program = fxshard.trace(model, model_loss, pieces[0], optimizer=optimizer)
    mesh = fxshard.Mesh(pp=2, dp=2)
    config = fxshard.Config(sharding="optim_grads_params", microbatches=4)
    stages = [run_pipeline(program, mesh, config, stage=stage)[-1] for stage in range(mesh.pp)]
    sms = {"pp": 8, "fsdp": 16}
    lowered_stages = []
    for stage in stages:
        for budget in (math.inf, None):
            lowered, stretches = carve_out_sms(stage.graph_module, sms, **({"flops_per_byte": budget} if budget else {}))
            assert stretches > 0
            carved, in_flight, seen = None, {}, collections.Counter()
            for node in lowered.graph.nodes:
                if node.target is set_sm_carveout:
                    carved = node.args[0]
                elif transfer_kind(node) is not None:
                    in_flight[node] = transfer_kind(node)
                elif node.target is c10d.wait_tensor.default:
                    in_flight.pop(node.args[0], None)
                elif node.target in MATMULS:
                    receiving = any(n.target is torch.ops.fxshard.recv.default for n in in_flight)
                    widest = max((sms[kind] for kind in in_flight.values()), default=None)
                    if budget:  # unbounded: exactly the largest kind in flight
                        assert carved == widest, (node.name, carved, widest)
                    else:  # bounded: never outside a window, and a posted receive always counts
                        assert carved is None or widest is not None, node.name
                        assert not receiving or carved >= sms["pp"], node.name
                    seen[receiving] += 1
            assert carved is None and seen[True] and seen[False]  # cleared at the end; both kinds of matmul met
        lowered_stages.append(stage.replace(graph_module=lowered))
    local = [{k: torch.cat([p[k] for p in pieces[i * 4:(i + 1) * 4]]) for k in pieces[0]} for i in range(2)]
    assert_step_like_eager(lowered_stages, model, optimizer, mesh, [local[mesh.coords(r)["dp"]] for r in range(mesh.size)],
                           pieces, model_loss)
    assert torch._C._get_sm_carveout_experimental() is None  # left as found


def test_sm_carveouts_are_checked():
    for knob in ("ep_sm_carveout", "pp_sm_carveout", "fsdp_sm_carveout"):
        for bad in (-1, 1.5, "16", True):
            try:
                fxshard.Config(**{knob: bad})
            except fxshard.FxShardError as error:
                assert knob in str(error)
            else:
                raise AssertionError(f"{knob}={bad!r} accepted")
