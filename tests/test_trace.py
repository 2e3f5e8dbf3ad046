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


def test_ops_between_two_layers_belong_to_the_layer_before_and_after_the_last_one_to_post():
    """With a block's attention and MLP as layers, what the block runs outside both (its norms, its
    residual adds) belongs to the layer before, or to "pre" before the first: the stage split can cut
    between them (tests/passes/test_pipeline_split.py). After the last layer, "post" as before."""
    model = GPT(GPTConfig.preset("tiny"))
    blocks = fxshard.trace(model, model_loss, tiny_batch())
    halves = fxshard.trace(model, model_loss, tiny_batch(), config=fxshard.Config(layers=("layers.*.attn",
                                                                                        "layers.*.mlp")))
    assert halves.notes["layers"] == ["layers.0.attn", "layers.0.mlp", "layers.1.attn", "layers.1.mlp"]
    pairs = [(a, b) for a, b in zip(blocks.graph.nodes, halves.graph.nodes)
             if a.op == "call_function" and meta.phase(a) in (meta.FWD, meta.BWD)]
    assert all(a.name == b.name for a, b in pairs)  # the same graph, other layers
    allowed = {"pre": {"pre"}, "post": {"post"}, "layers.0": {"pre", "layers.0.attn", "layers.0.mlp"},
               "layers.1": {"layers.0.mlp", "layers.1.attn", "layers.1.mlp", "post"}}
    for a, b in pairs:
        assert meta.layer(b) in allowed[meta.layer(a)], (a.format_node(), meta.layer(a), meta.layer(b))
    # of the blocks' forward, only the last residual add (after the last layer) is post
    moved = [b for a, b in pairs if meta.phase(a) == meta.FWD and meta.layer(a) != "post" and meta.layer(b) == "post"]
    assert [n.target for n in moved] == [torch.ops.aten.add.Tensor]
    # the norms, in order: the first block's attention norm (before any layer), each MLP's norm (after its
    # block's attention), the next block's attention norm (after the MLP before it), the final norm
    norms = [meta.layer(n) for n in halves.graph.nodes if n.target is torch.ops.aten.rsqrt.default
             and meta.phase(n) == meta.FWD]
    assert norms == ["pre", "layers.0.attn", "layers.0.mlp", "layers.1.attn", "post"]
    known = {*halves.notes["layers"], "pre", "post"}
    assert all(meta.layer(n) in known for n in halves.graph.nodes if n.op != "output")  # backward too


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


class _Rebinds(torch.nn.Module):
    """Updates its buffers by rebinding them (a step counter, an EMA of the loss input), not in place."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 1)
        self.register_buffer("count", torch.zeros(()))
        self.register_buffer("ema", torch.zeros(4))

    def forward(self, x):
        self.count = self.count + 1
        self.ema = 0.9 * self.ema + 0.1 * x.mean(0)
        return self.linear(x).squeeze(-1)


def test_a_buffer_rebound_in_forward_is_updated_like_one_updated_in_place():
    torch.manual_seed(0)
    batches = [{"x": torch.randn(8, 4), "y": torch.randn(8)} for _ in range(3)]
    loss_fn = lambda m, b: ((m(b["x"]) - b["y"]) ** 2).mean()  # noqa: E731
    model, reference = _Rebinds(), _Rebinds()
    reference.load_state_dict(model.state_dict())
    step = fxshard.shard(model, loss_fn, batches[0], optimizer=fxshard.optim.SGD(lr=0.1))
    for batch in batches:
        step(batch)
        loss_fn(reference, batch)
    assert step.buffers()["count"].item() == 3.0
    torch.testing.assert_close(step.buffers()["ema"], reference.ema)
    assert model.count.item() == 0.0  # the user's model is left as it was


def test_metric_names_the_step_reports_itself_and_leaves_microbatches_cannot_split_are_refused():
    linear = torch.nn.Linear(4, 1)
    batch = {"x": torch.randn(8, 4), "y": torch.randn(8)}
    loss = lambda m, b: ((m(b["x"]).squeeze(-1) - b["y"]) ** 2).mean()  # noqa: E731
    with pytest.raises(fxshard.FxShardError, match=r"metrics \['grad_norm'\] have names the step's own outputs"):
        fxshard.trace(linear, lambda m, b: (loss(m, b), {"grad_norm": loss(m, b).detach()}), batch)
    weighted = {**batch, "weight": torch.tensor([0.5, 2.0])}  # not per row: microbatches would cut it too
    with pytest.raises(fxshard.FxShardError, match=r"every leaf needs the same first dimension.*'weight'\] \(2,\)"):
        fxshard.trace(linear, lambda m, b: loss(m, b) * b["weight"].sum(), weighted,
                      config=fxshard.Config(microbatches=2))
    scaled = {**batch, "scale": torch.tensor(2.0)}  # a 0-dim leaf: fine without microbatches
    fxshard.trace(linear, lambda m, b: loss(m, b) * b["scale"], scaled)


def test_tracing_leaves_the_models_attributes_as_they_were():
    class Stash(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear, self.calls = torch.nn.Linear(4, 1), 0

        def forward(self, x):
            self.calls += 1
            self.last = self.linear(x)  # a fake tensor of the trace, were it kept
            return self.last

    model = Stash()
    fxshard.trace(model, lambda m, b: m(b["x"]).square().mean(), {"x": torch.randn(8, 4)})
    assert model.calls == 0 and not hasattr(model, "last")


def test_a_module_registered_under_two_paths_trains_like_eager_and_keeps_its_own_tensors():
    """ALBERT-style sharing (one block at every position of a ModuleList) and an attribute alias: torch's
    functional_call restores the trace's tensors into such a module; the tracer puts the model's back."""
    from fxshard.testing import eager_parity

    class Shared(torch.nn.Module):
        def __init__(self):
            super().__init__()
            block = torch.nn.Sequential(torch.nn.LayerNorm(8), torch.nn.Linear(8, 8))
            self.layers = torch.nn.ModuleList([block] * 3)
            self.head = torch.nn.Linear(8, 1)
            self.alias = self.head

        def forward(self, x):
            for layer in self.layers:
                x = x + layer(x)
            return self.alias(torch.tanh(self.head(x)) * x)

    torch.manual_seed(0)
    model = Shared()
    before = dict(model.named_parameters())
    generator = torch.Generator().manual_seed(0)
    batches = [{"x": torch.randn(4, 8, generator=generator), "y": torch.randn(4, 1, generator=generator)}
               for _ in range(3)]
    loss = lambda m, b: ((m(b["x"]) - b["y"]) ** 2).mean()
    parity = eager_parity(model, loss, batches, fxshard.optim.AdamW(lr=1e-2))
    assert parity.max_loss_rel < 1e-6 and parity.max_param_rel < 1e-5, parity
    assert all(p is before[name] and type(p) is torch.nn.Parameter for name, p in model.named_parameters())


def test_a_torch_compiled_function_or_module_in_the_forward_is_traced_as_its_python():
    """torchtitan compiles flex_attention and its mask builder at module level; a user may call
    module.compile(). While fxshard traces they run as their Python (fxshard compiles the step), so
    the step trains as the same model written without torch.compile (never run compiled here)."""
    import torch.nn.functional as F

    compiled_gelu = torch.compile(F.gelu)

    class Model(torch.nn.Module):
        def __init__(self, compiled):
            super().__init__()
            self.first, self.second = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)
            self.compiled = compiled
            if compiled:
                self.second.compile()

        def forward(self, x):
            return self.second((compiled_gelu if self.compiled else F.gelu)(self.first(x)))

    torch.manual_seed(0)
    batches = [{"x": torch.randn(4, 8)} for _ in range(3)]
    losses = []
    for compiled in (True, False):
        torch.manual_seed(1)
        step = fxshard.shard(Model(compiled), lambda m, b: (m(b["x"]) ** 2).mean(), batches[0],
                             optimizer=fxshard.optim.AdamW(lr=1e-2))
        losses.append([step(batch)["loss"].item() for batch in batches])
    assert losses[0] == losses[1]
