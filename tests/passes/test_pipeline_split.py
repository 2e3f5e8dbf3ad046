"""The stage split (passes/pipeline.py) run by the in-process pipeline executor equals eager PyTorch."""

import copy

import pytest
import torch
from hypothesis import given, strategies as st

import fxshard
from fxshard import schedule as schedules
from fxshard.batch import BatchSpec
from fxshard.models import GPT, GPTConfig, MoEGPT, MoEGPTConfig
from fxshard.passes.pipeline import assign_layers, split_stages
from fxshard.program import InputKind, OutputKind
from fxshard.runtime.pipeline import run_local


def model_loss(model, batch):
    return model.loss(batch)


def token_microbatches(vocab, count, rows=2, seq=8, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [{"idx": torch.randint(0, vocab, (rows, seq), generator=generator),
             "tgt": torch.randint(0, vocab, (rows, seq), generator=generator)} for _ in range(count)]


def unsplit_program_run(program, params, leaves):
    """The un-rewritten program on one microbatch: (loss, {param: gradient}). Traced with plain SGD at
    lr 1, so each gradient is the parameter minus its update."""
    args = []
    batch = iter(leaves)
    for spec in program.inputs:
        if spec.kind is InputKind.BATCH:
            args.append(next(batch))
        elif spec.kind in (InputKind.LR, InputKind.STEP):
            args.append(torch.tensor(1.0))
        else:
            args.append(params[spec.name])
    outputs = dict(zip([(o.kind, o.name) for o in program.outputs], program.graph_module(*args)))
    grads = {name: params[name] - value for (kind, name), value in outputs.items() if kind is OutputKind.PARAM}
    return outputs[OutputKind.LOSS, "loss"], grads


def check_pipeline(model, loss_fn, microbatches, schedule, stage_layers=None):
    program = fxshard.trace(model, loss_fn, microbatches[0], optimizer=fxshard.optim.SGD(lr=1.0))
    pipeline = split_stages(program, schedule.chunks, stage_layers)
    params = {name: p.detach() for name, p in model.named_parameters()}
    params.update({name: b for name, b in model.named_buffers()})
    leaves = [BatchSpec.from_example(mb).flatten(mb) for mb in microbatches]
    ranks = run_local(pipeline, schedule, params, leaves)
    losses, grads = {}, {}
    for rank in ranks:
        losses.update(rank.losses)
        for name, grad in rank.grads.items():
            grads[name] = grads[name] + grad if name in grads else grad
    reference = copy.deepcopy(model)
    ref_losses = [loss_fn(reference, mb) for mb in microbatches]
    (sum(ref_losses) / len(microbatches)).backward()
    for index, ref_loss in enumerate(ref_losses):
        assert abs(losses[index].item() - ref_loss.item()) <= 1e-5 * abs(ref_loss.item())
    for name, p in reference.named_parameters():
        if p.requires_grad:
            scale = max(p.grad.abs().max().item(), 1e-6)
            assert (grads[name] / len(microbatches) - p.grad).abs().max().item() <= 1e-5 * scale, name
    # and against the program the split was cut from, microbatch by microbatch
    unsplit = [unsplit_program_run(program, params, mb_leaves) for mb_leaves in leaves]
    for index, (loss, _) in enumerate(unsplit):
        assert abs(losses[index].item() - loss.item()) <= 1e-5 * abs(loss.item())
    for name, expected in unsplit[0][1].items():
        total = sum(g[name] for _, g in unsplit)
        # each program gradient is param - (param - grad): rounded at the parameter's magnitude
        tolerance = 1e-5 * total.abs().max().item() + 1e-6 * params[name].abs().max().item()
        assert (grads[name] - total).abs().max().item() <= tolerance, name
    return pipeline


@given(layers=st.integers(1, 4), stages=st.integers(1, 3), virtual=st.integers(1, 2), rounds=st.integers(1, 2),
       kind=st.sampled_from(["gpipe", "1f1b", "interleaved", "zb-h1"]), data=st.data())
def test_every_schedule_over_the_split_computes_eager_losses_and_gradients(layers, stages, virtual, rounds,
                                                                          kind, data):
    if kind in ("1f1b", "zb-h1"):
        virtual = 1
    if stages * virtual > layers:
        virtual = 1
        stages = data.draw(st.integers(1, layers), label="stages")
    microbatches = stages * rounds
    schedule = {"gpipe": lambda: schedules.gpipe(stages, microbatches, virtual),
                "1f1b": lambda: schedules.one_f_one_b(stages, microbatches),
                "interleaved": lambda: schedules.interleaved_one_f_one_b(stages, microbatches, virtual),
                "zb-h1": lambda: schedules.zero_bubble_h1(stages, microbatches)}[kind]()
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=24, d_model=16, n_layer=layers, n_head=2, d_ff=24))
    check_pipeline(model, model_loss, token_microbatches(24, microbatches), schedule)


def test_moe_gpt_over_four_chunks():
    torch.manual_seed(0)
    model = MoEGPT(MoEGPTConfig.preset("tiny", n_layer=4))
    check_pipeline(model, model_loss, token_microbatches(64, 4), schedules.interleaved_one_f_one_b(2, 4, 2))


def test_tied_embedding_gets_a_partial_gradient_on_the_first_and_the_last_chunk():
    from test_foreign_models import GPT2

    torch.manual_seed(0)
    model = GPT2(layers=2)
    pipeline = check_pipeline(model, lambda m, b: m(b["idx"], b["tgt"]), token_microbatches(40, 2),
                              schedules.one_f_one_b(2, 2))
    first, last = pipeline.chunks[0], pipeline.chunks[-1]
    assert "wte.weight" in first.grads and "wte.weight" in last.grads
    assert "wte.weight" in first.params and "wte.weight" in last.params
    assert "wpe.weight" not in first.grads  # frozen


def test_layers_are_balanced_by_parameter_bytes_or_set_by_stage_layers():
    layers = [f"layers.{i}" for i in range(5)]
    sizes = {"layers.0": 100, "layers.1": 100, "layers.2": 100, "layers.3": 100, "layers.4": 400}
    assert assign_layers(layers, 2, sizes) == [["pre", *layers[:4]], ["layers.4", "post"]]
    assert assign_layers(layers, 2, sizes, [2, 3]) == [["pre", *layers[:2]], [*layers[2:], "post"]]
    with pytest.raises(fxshard.FxShardError, match="only 5 layers"):
        assign_layers(layers, 6, sizes)
    with pytest.raises(fxshard.FxShardError, match="stage_layers"):
        assign_layers(layers, 2, sizes, [1, 1])


def test_zero_bubble_runs_the_weight_gradients_split_off_the_backward():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=24, d_model=16, n_layer=3, n_head=2, d_ff=24))
    pipeline = check_pipeline(model, model_loss, token_microbatches(24, 3), schedules.zero_bubble_h1(3, 3))
    middle = pipeline.chunks[1]
    assert middle.carry and len(middle.backward_weight.graph.nodes) > 0


class ScaledBlock(torch.nn.Module):
    """Reads a tensor constant made in its forward (a get_attr in the traced graph, like the cache
    objects of Hugging Face decoders)."""

    def __init__(self, width):
        super().__init__()
        self.linear = torch.nn.Linear(width, width)

    def forward(self, x):
        return torch.tanh(self.linear(x)) * torch.tensor([0.5, 2.0]).repeat(x.shape[-1] // 2)


class ScaledBlocks(torch.nn.Module):
    def __init__(self, width=8, layers=3):
        super().__init__()
        self.layers = torch.nn.ModuleList(ScaledBlock(width) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.mark.parametrize("kind", ["1f1b", "zb-h1"])
def test_constants_are_copied_into_every_chunk_that_reads_them(kind):
    torch.manual_seed(0)
    model = ScaledBlocks()
    generator = torch.Generator().manual_seed(0)
    microbatches = [{"x": torch.randn(2, 8, generator=generator), "y": torch.randn(2, 8, generator=generator)}
                    for _ in range(3)]
    schedule = schedules.one_f_one_b(3, 3) if kind == "1f1b" else schedules.zero_bubble_h1(3, 3)
    pipeline = check_pipeline(model, lambda m, b: ((m(b["x"]) - b["y"]) ** 2).mean(), microbatches, schedule)
    for chunk in pipeline.chunks:
        assert any(n.op == "get_attr" for n in chunk.forward.graph.nodes), chunk.index
