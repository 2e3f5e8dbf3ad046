"""Meta-device models: initialized per module, seeded by module path, each rank building only its shards."""

import json
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

import fxshard
from fxshard.init import MetaInit
from fxshard.models import GPT, GPTConfig, MoEGPT, MoEGPTConfig
from fxshard.passes.fsdp import STRATEGIES, FSDPConfig, fsdp
from fxshard.testing import SimulatedRanks

BATCH = {"idx": torch.zeros(2, 8, dtype=torch.long), "tgt": torch.zeros(2, 8, dtype=torch.long)}


def loss_fn(model, batch):
    return model.loss(batch)


def meta_model(cls=GPT, cfg=GPTConfig):
    with torch.device("meta"):
        return cls(cfg.preset("tiny"))


@pytest.mark.parametrize("world", [1, 3, 8])
def test_every_rank_shard_equals_the_slice_of_the_single_device_init(world):
    model = meta_model(MoEGPT, MoEGPTConfig)
    full = MetaInit(model, seed=7, device="cpu").materialize_all()
    program = fsdp(fxshard.trace(model, loss_fn, BATCH), FSDPConfig(world))
    for unit in program.units:
        whole = unit.flatten(full)
        shards = [MetaInit(model, seed=7, device="cpu").unit_shard(unit, rank) for rank in range(world)]
        assert torch.equal(torch.cat(shards), whole), unit.name
    assert all(p.is_meta for p in model.parameters())  # the user's model is left on meta
    other_seed = MetaInit(model, seed=8, device="cpu").materialize_all()
    assert not torch.equal(other_seed["layers.0.attn.qkv.weight"], full["layers.0.attn.qkv.weight"])


def test_single_device_shard_of_a_meta_model_initializes_and_trains():
    model = meta_model()
    step = fxshard.shard(model, loss_fn, BATCH, config=fxshard.Config(seed=3))
    expected = MetaInit(model, seed=3, device="cpu").materialize_all()
    for name, value in step.parameters().items():
        assert torch.equal(value, expected[name]), name
    first = step(BATCH)["loss"].item()
    for _ in range(5):
        last = step(BATCH)["loss"].item()
    assert last < first


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_sharded_meta_init_trains_like_the_materialized_model(strategy):
    world, model = 2, meta_model()
    batch = {k: v.repeat(world, 1) for k, v in BATCH.items()}
    single = fxshard.shard(model, loss_fn, batch, config=fxshard.Config(seed=5))
    program = fsdp(fxshard.trace(model, loss_fn, BATCH), FSDPConfig(world, strategy))
    ranks = SimulatedRanks(program, MetaInit(model, seed=5, device="cpu"), fxshard.optim.AdamW(),
                           fxshard.Mesh(dp=world))
    for _ in range(2):
        expected = single(batch)["loss"]
        for metrics in ranks.step([BATCH] * world):
            assert torch.allclose(metrics["loss"], expected, rtol=1e-5)


@pytest.mark.parametrize("torchtitan", [False, True])
def test_a_module_without_an_initializer_is_a_clear_error(torchtitan):
    """A plain module with parameters and no reset_parameters() is refused by name; a torchtitan module's
    `_init_self_parameters` raises a ValueError for parameters it has no initializer for, which fxshard
    reports naming the module and the cause."""
    import model_zoo as zoo

    class Scale(zoo.Module if torchtitan else nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(4))

        def forward(self, x):
            return x * self.scale

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), Scale())
    expected = "'1' \\(Scale\\) .*ValueError: Scale has parameters" if torchtitan else "reset_parameters"
    with pytest.raises(fxshard.FxShardError, match=expected):
        fxshard.shard(model, lambda m, b: m(b).sum(), torch.zeros(2, 4))


def test_an_initializer_that_leaves_a_tensor_unset_is_a_clear_error():
    """Tensors start as NaN on the device: one that reset_parameters() does not write is refused by name
    (it used to keep whatever memory to_empty() handed out)."""
    class Half(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight, self.extra = nn.Parameter(torch.ones(4)), nn.Parameter(torch.ones(4))

        def reset_parameters(self):
            nn.init.ones_(self.weight)

        def forward(self, x):
            return x * self.weight * self.extra

    with torch.device("meta"):
        model = Half()
    with pytest.raises(fxshard.FxShardError, match="leaves extra \\(partly\\) unset"):
        fxshard.shard(model, lambda m, b: m(b).sum(), torch.zeros(2, 4))


def test_a_transformers_moe_built_on_meta_initializes_as_the_model_does_and_loads_its_checkpoint(tmp_path):
    """A transformers model has no reset_parameters() on its norms, experts or rotary tables: the
    model's own _init_weights(module) initializes each module (rotary inv_freq recomputed), and
    load_hf then fills every parameter from the model's save_pretrained directory; the step trains
    like the source model in eager."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=32, moe_intermediate_size=16,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                      num_experts=4, num_experts_per_tok=2, attention_dropout=0.0)
    torch.manual_seed(0)
    source = transformers.Qwen3MoeForCausalLM(cfg)
    source.save_pretrained(tmp_path)
    with torch.device("meta"):
        model = transformers.Qwen3MoeForCausalLM(cfg)
    batch = {"input_ids": torch.randint(0, 64, (2, 8)), "labels": torch.randint(0, 64, (2, 8))}
    step = fxshard.shard(model, lambda m, b: m(**b).loss, batch, fxshard.optim.SGD(lr=0.0))
    initial = step.parameters()
    assert all(torch.isfinite(v).all() for v in initial.values())
    assert torch.equal(initial["model.norm.weight"], torch.ones(32))  # the model's scheme: norms at one
    fxshard.load_hf(step, tmp_path)
    loaded = step.parameters()
    assert all(torch.equal(loaded[n], p) for n, p in source.named_parameters())
    with torch.no_grad():
        want = source(**batch).loss
    assert torch.allclose(step(batch)["loss"], want, rtol=1e-5)  # rotary tables and weights as the source's


def test_a_transformers_gpt2_on_meta_keeps_its_tie_and_its_scaled_residual_init():
    """GPT-2's lm_head is its embedding (materializing the embedding must not untie them), and its
    attention block rescales c_proj when initialized as a parent (std 0.02 / sqrt(2 n_layer)), which
    initialize_weights does after the children: both as `from_config` has them."""
    import math

    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=64, n_layer=8, n_head=4, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(cfg)
    batch = {"input_ids": torch.randint(0, 64, (2, 8)), "labels": torch.randint(0, 64, (2, 8))}
    step = fxshard.shard(model, lambda m, b: m(**b).loss, batch, fxshard.optim.SGD(lr=0.0))
    assert model.lm_head.weight is model.transformer.wte.weight
    params = step.parameters()
    assert "lm_head.weight" not in params and len(params) == len(dict(model.named_parameters()))
    c_proj = torch.cat([params[f"transformer.h.{i}.attn.c_proj.weight"].flatten() for i in range(8)])
    assert abs(c_proj.std().item() - 0.02 / math.sqrt(2 * 8)) < 0.001, c_proj.std()
    assert math.isfinite(step.evaluate(batch)["loss"].item())


@pytest.mark.parametrize("name, tie", [("titan_llama3", True), ("titan_deepseek_v3", False)])
def test_a_torchtitan_model_on_meta_initializes_as_its_init_states_does(name, tie):
    """torchtitan builds its models on meta and initializes them with `init_states`: each module's
    `param_init` functions (its Linears trunc_normal(0.02), not nn.Linear's reset_parameters), then its
    buffers (the rotary cache recomputed, the MoE's counters zeroed). fxshard runs the same per module;
    a tied embedding, whose own initializer skips it, takes the output head's. Deterministic tensors
    equal `init_states`' values, random ones have its spread, and the step trains like eager."""
    import model_zoo as zoo

    build = (lambda: zoo.titan_llama3(tie=True)) if tie else zoo.MODELS[name][0]
    with torch.device("meta"):
        model = build()
    values = MetaInit(model, seed=3, device="cpu").materialize_all()
    references = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        reference = build()
        reference.init_states(buffer_device=torch.device("cpu"))
        references.append({**dict(reference.named_parameters()), **dict(reference.named_buffers())})
    assert values.keys() == references[0].keys()
    for key, value in values.items():
        want, other = references[0][key], references[1][key]
        if torch.equal(want, other):  # deterministic: ones, zeros, the rotary cache
            assert torch.equal(value, want), key
        else:
            assert 0.75 < value.std().item() / want.std().item() < 1.33, (key, value.std(), want.std())
    if tie:
        assert model.tok_embeddings.weight is model.lm_head.weight
        assert values["tok_embeddings.weight"].std().item() < 0.5  # the head's dim ** -0.5, not the embedding's 1.0

    batch = zoo.masked_batches(name, 1)[0]
    step = fxshard.shard(model, zoo.titan_loss, batch, fxshard.optim.SGD(lr=0.0), config=fxshard.Config(seed=3))
    eager = build()
    eager.load_state_dict({**values, **step.parameters()}, strict=False)
    with torch.no_grad():
        want = zoo.titan_loss(eager, batch)
    assert torch.allclose(step(batch)["loss"], want, rtol=1e-5)


_SHARD_1B = """
import json, resource, torch, fxshard
from fxshard.init import MetaInit
from fxshard.models import GPT, GPTConfig
from fxshard.passes.fsdp import FSDPConfig, fsdp
with torch.device("meta"):
    model = GPT(GPTConfig.preset("1b", n_layer=4))  # 1b's widths, 4 of its layers: 1.3 GB in fp32
batch = {"idx": torch.zeros(1, 128, dtype=torch.long), "tgt": torch.zeros(1, 128, dtype=torch.long)}
program = fsdp(fxshard.trace(model, lambda m, b: m.loss(b), batch), FSDPConfig(8))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
init = MetaInit(model, seed=0, device="cpu")
shard_bytes = sum(init.unit_shard(unit, 3).numel() * 4 for unit in program.units)
print(json.dumps({"grown": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before,
                  "shard_bytes": shard_bytes, "full_bytes": sum(p.numel() * 4 for p in model.parameters())}))
"""


def test_a_rank_of_8_builds_its_shards_of_a_1b_wide_model_without_the_full_model():
    result = subprocess.run([sys.executable, "-c", _SHARD_1B], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["full_bytes"] > 1.2e9
    # its shards plus one module at a time (the largest, the 32000x2048 embedding, is 262 MB), well
    # under the full model
    assert report["grown"] < report["shard_bytes"] + 1.5 * 262e6, report
