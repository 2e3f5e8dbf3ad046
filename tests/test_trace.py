"""The traced Program: one joint graph whose every node carries its phase, layer and parameter."""

import json
import subprocess
import sys

import pytest
import torch

import fxshard
from fxshard import InputKind, OutputKind, meta
from fxshard.models import GPT, GPTConfig, MoEGPT, MoEGPTConfig


def tiny_batch(batch=2, seq=8):
    return {"idx": torch.zeros(batch, seq, dtype=torch.long), "tgt": torch.zeros(batch, seq, dtype=torch.long)}


def model_loss(model, batch):
    return model.loss(batch)


@pytest.fixture(scope="module")
def moe_program():
    torch.manual_seed(0)
    return fxshard.trace(MoEGPT(MoEGPTConfig.preset("tiny")), model_loss, tiny_batch())


def test_every_node_has_a_phase_and_a_layer(moe_program):
    for node in moe_program.graph.nodes:
        if node.op == "output":
            continue
        assert meta.phase(node) in meta.PHASES, node.format_node()
        assert meta.layer(node) in {"pre", "post", "layers.0", "layers.1"}, node.format_node()


def test_backward_nodes_inherit_their_forward_layer(moe_program):
    grouped = [n for n in moe_program.graph.nodes if n.op == "call_function"
               and "grouped_mm" in str(n.target)]
    forward = [n for n in grouped if meta.phase(n) == meta.FWD]
    backward = [n for n in grouped if meta.phase(n) == meta.BWD]
    # two grouped GEMMs per layer forward; a data- and a weight-gradient node each backward
    assert sorted(meta.layer(n) for n in forward) == ["layers.0"] * 2 + ["layers.1"] * 2
    assert sorted(meta.layer(n) for n in backward) == ["layers.0"] * 4 + ["layers.1"] * 4
    assert sum("wgrad" in str(n.target) for n in backward) == 4


def test_parameters_their_gradients_and_updates_are_named(moe_program):
    names = {i.name for i in moe_program.inputs_of(InputKind.PARAM)}
    assert "layers.0.moe.experts.fc1.weight" in names
    gradients = {meta.param(n) for n in moe_program.graph.nodes if meta.phase(n) == meta.BWD and meta.param(n)}
    assert gradients == names
    updated = {o.name for o in moe_program.outputs_of(OutputKind.PARAM)}
    assert updated == names
    placeholders = dict(zip(moe_program.inputs, moe_program.placeholders()))
    for spec, node in placeholders.items():
        if spec.kind is InputKind.PARAM:
            assert meta.param(node) == spec.name
            expected = spec.name.split(".moe")[0].split(".attn")[0].split(".mlp_norm")[0]
            expected = expected if expected.startswith("layers.") else ("pre" if "emb" in spec.name else "post")
            assert meta.layer(node) == expected, spec.name


def test_optimizer_nodes_form_the_optim_phase_after_the_gradients(moe_program):
    phases = [meta.phase(n) for n in moe_program.graph.nodes if n.op == "call_function"]
    first_optim = phases.index(meta.OPTIM)
    assert meta.OPTIM not in phases[:first_optim] and set(phases[first_optim:]) == {meta.OPTIM}
    assert meta.FWD in phases and meta.BWD in phases


def test_config_layers_accepts_globs():
    model = GPT(GPTConfig.preset("tiny"))
    program = fxshard.trace(model, model_loss, tiny_batch(), config=fxshard.Config(layers=["layers.*.mlp"]))
    assert program.notes["layers"] == ["layers.0.mlp", "layers.1.mlp"]
    layers = {meta.layer(n) for n in program.graph.nodes if meta.phase(n) == meta.BWD}
    assert {"layers.0.mlp", "layers.1.mlp", "pre", "post"} <= layers
    with pytest.raises(fxshard.FxShardError, match="matched no module"):
        fxshard.trace(model, model_loss, tiny_batch(), config=fxshard.Config(layers=["blocks.*"]))


_TRACE_1B = """
import json, resource, time, torch, fxshard
from fxshard.models import MoEGPT, MoEGPTConfig
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
started = time.perf_counter()
with torch.device("meta"):
    model = MoEGPT(MoEGPTConfig.preset("1b"))
batch = {"idx": torch.zeros(1, 2048, dtype=torch.long), "tgt": torch.zeros(1, 2048, dtype=torch.long)}
program = fxshard.trace(model, lambda m, b: m.loss(b), batch)
print(json.dumps({"seconds": time.perf_counter() - started,
                  "grown": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before,
                  "parameter_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
                  "param_inputs": len(program.inputs_of(fxshard.InputKind.PARAM)),
                  "parameters": len(list(model.parameters()))}))
"""


def test_moe_gpt_1b_traces_on_meta_quickly_without_parameter_memory():
    # A fresh process, so the peak-RSS reading belongs to this trace alone.
    result = subprocess.run([sys.executable, "-c", _TRACE_1B], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["parameter_bytes"] > 3.5e9  # ~0.94B fp32 parameters
    assert report["seconds"] < 60
    assert report["grown"] < report["parameter_bytes"] / 8, f"peak RSS grew {report['grown'] / 2**20:.0f} MiB"
    assert report["param_inputs"] == report["parameters"]
