"""Models not written for fxshard, in the style of common open-source code, train with parity."""

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxshard
from fxshard.testing import eager_parity

ADAMW = fxshard.optim.AdamW(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


class GPT2Block(nn.Module):
    """nanoGPT/HF-GPT2 style: LayerNorm, fused c_attn, a registered causal-mask buffer, tanh GELU."""

    def __init__(self, width, heads, block_size):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.c_attn, self.c_proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.c_fc, self.mlp_proj = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
        self.heads = heads
        self.register_buffer("bias", torch.tril(torch.ones(block_size, block_size)).view(1, 1, block_size, block_size))

    def attention(self, x):
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(k.size(-1))
        att = F.softmax(att.masked_fill(self.bias[:, :, :t, :t] == 0, float("-inf")), dim=-1)
        return self.c_proj((att @ v).transpose(1, 2).contiguous().view(b, t, c))

    def forward(self, x):
        x = x + self.attention(self.ln_1(x))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT2(nn.Module):
    """Tied token embedding and LM head, learned positions, a frozen position table after init."""

    def __init__(self, vocab=40, width=32, heads=4, layers=2, block_size=16):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, width), nn.Embedding(block_size, width)
        self.h = nn.ModuleList(GPT2Block(width, heads, block_size) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.lm_head.weight = self.wte.weight
        self.wpe.weight.requires_grad_(False)

    def forward(self, idx, targets):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


class ConvNet(nn.Module):
    """A small CNN with BatchNorm (mutated running-statistics buffers) and ReLU."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.stages = nn.Sequential(*[nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
                                      for _ in range(2)])
        self.fc = nn.Linear(8, 10)

    def forward(self, x):
        return self.fc(self.stages(self.stem(x)).mean((2, 3)))


def test_gpt2_style_model_with_tied_and_frozen_weights():
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 40, (2, 16), generator=generator),
                torch.randint(0, 40, (2, 16), generator=generator)) for _ in range(10)]
    model = GPT2()
    adamw = eager_parity(model, lambda m, b: m(*b), batches, ADAMW)
    assert adamw.max_loss_rel < 1e-5, adamw.losses
    # The key half of c_attn.bias has an exactly-zero true gradient (softmax ignores a per-query
    # constant), so both runs see rounding noise there and Adam scales noise to full-size steps:
    # compare parameters under SGD, where an update is proportional to its gradient.
    sgd = eager_parity(model, lambda m, b: m(*b), batches, fxshard.optim.SGD(lr=0.01, momentum=0.9))
    assert sgd.max_loss_rel < 1e-5, sgd.losses
    assert sgd.max_param_rel < 1e-4
    program = fxshard.trace(model, lambda m, b: m(*b), batches[0], optimizer=ADAMW)
    trainable = [i.name for i in program.inputs_of(fxshard.InputKind.PARAM) if i.requires_grad]
    assert "wte.weight" in trainable and "lm_head.weight" not in trainable  # tied: one parameter
    assert "wpe.weight" not in trainable
    assert program.notes["layers"] == ["h.0", "h.1"]


def test_convnet_with_batchnorm_buffers_updates_running_stats():
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    batches = [{"x": torch.randn(4, 3, 8, 8, generator=generator), "y": torch.randint(0, 10, (4,), generator=generator)}
               for _ in range(6)]
    model = ConvNet()
    loss_fn = lambda m, b: F.cross_entropy(m(b["x"]), b["y"])  # noqa: E731
    step = fxshard.shard(model, loss_fn, batches[0], optimizer=fxshard.optim.SGD(lr=0.1, momentum=0.9))
    reference = ConvNet()
    reference.load_state_dict(model.state_dict())
    torch_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for batch in batches:
        metrics = step(batch)
        torch_opt.zero_grad()
        loss = loss_fn(reference, batch)
        loss.backward()
        torch_opt.step()
        assert metrics["loss"].item() == pytest.approx(loss.item(), rel=1e-5)
    for name, buffer in reference.named_buffers():
        assert torch.allclose(step.buffers()[name].float(), buffer.float(), rtol=1e-5, atol=1e-6), name
    assert step.buffers()["stages.0.1.num_batches_tracked"].item() == len(batches)


class TitanStyleGPT(nn.Module):
    """torchtitan keeps its transformer blocks in a ModuleDict keyed "0", "1", ... (so that a
    pipeline stage can delete the others and keep the names)."""

    def __init__(self, layers=2):
        super().__init__()
        from fxshard.models import GPTConfig
        from fxshard.models.gpt import GPT

        inner = GPT(GPTConfig.preset("tiny", n_layer=layers))
        self.cfg, self.tok_emb, self.norm, self.output = inner.cfg, inner.tok_emb, inner.norm, inner.head
        self.layers = nn.ModuleDict({str(i): block for i, block in enumerate(inner.layers)})

    def forward(self, batch):
        from fxshard.models.blocks import rope_tables

        x = self.tok_emb(batch["idx"])
        cos, sin = rope_tables(x.shape[1], self.cfg.d_model // self.cfg.n_head, self.cfg.rope_theta, x.device)
        for block in self.layers.values():
            x = block(x, cos, sin)
        logits = self.output(self.norm(x))
        return F.cross_entropy(logits.flatten(0, 1), batch["tgt"].flatten())


def test_blocks_in_a_module_dict_are_the_layers_for_units_and_pipeline_cuts():
    from fxshard import meta
    from fxshard.layers import find_layers

    torch.manual_seed(0)
    model = TitanStyleGPT(layers=4)
    assert find_layers(model) == ["layers.0", "layers.1", "layers.2", "layers.3"]
    batch = {"idx": torch.randint(0, 64, (4, 8)), "tgt": torch.randint(0, 64, (4, 8))}
    program = fxshard.trace(model, lambda m, b: m(b), batch)
    assert {meta.layer(n) for n in program.graph.nodes} >= {"pre", "layers.0", "layers.3", "post"}
    # four layers to cut between: two stages of two chunks each
    fxshard.check(model, lambda m, b: m(b), batch, mesh=fxshard.Mesh(pp=2),
                  config=fxshard.Config(schedule="interleaved-1f1b", virtual_stages=2, microbatches=2))
    # torchtitan-style models with ModuleDict blocks train like eager on one device, under ZeRO-3 and
    # pp=2: the model matrix, tests/test_parity_models_gloo.py


class Hybrid(nn.Module):
    """A hybrid model's blocks (Jamba's attention and Mamba layers, Qwen3-Next's linear and full
    attention) in one ModuleList of two types, with a head that is itself a Sequential of mixed types."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(64, 16)
        self.blocks = nn.ModuleList([nn.Linear(16, 16), nn.GRU(16, 16, batch_first=True), nn.Linear(16, 16)])
        self.head = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 64))

    def forward(self, batch):
        x = self.embed(batch["idx"])
        for block in self.blocks:
            x = x + (block(x)[0] if isinstance(block, nn.GRU) else block(x))
        return F.cross_entropy(self.head(x).flatten(0, 1), batch["tgt"].flatten())


def test_blocks_of_several_types_in_one_list_are_the_layers():
    """They used to be refused for not being of one type, which left such a model without layers: one
    ZeRO-3 unit for all of it, nothing to cut a pipeline at, and no warning."""
    from fxshard.layers import find_layers

    model = Hybrid()
    assert find_layers(model) == ["blocks.0", "blocks.1", "blocks.2"]
    model.head = nn.Sequential(nn.Linear(16, 512), nn.LayerNorm(512), nn.Linear(512, 64))  # the largest container now
    assert find_layers(model) == ["blocks.0", "blocks.1", "blocks.2"]  # but a model, not a list of blocks


def test_transformers_llama_with_packed_sequences_trains_like_eager():
    """Tracing sets torch.compiler's compiling/exporting flags as torch.export does, so transformers
    builds its masks with tensor ops instead of reading them on the host (fxshard/trace.py). Padding
    masks, and transformers' MoE models (their grouped_mm experts in fp32): the model matrix,
    tests/test_parity_models_gloo.py."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    generator = torch.Generator().manual_seed(0)
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4], [0, 1, 2, 3, 0, 1, 2, 3]])  # two sequences in each row
    batches = [{"input_ids": torch.randint(0, 64, (2, 8), generator=generator), "position_ids": positions}
               for _ in range(3)]
    for batch in batches:
        batch["labels"] = batch["input_ids"]
    parity = eager_parity(model, lambda m, b: m(**b, use_cache=False).loss, batches, ADAMW)
    assert parity.max_loss_rel < 1e-5 and parity.max_param_rel < 1e-4, parity.losses
    assert not torch.compiler.is_compiling() and not torch.compiler.is_exporting()  # the flags are restored


def test_an_encoder_decoder_model_hears_that_its_encoder_blocks_are_not_layers_and_how_to_make_them_so():
    """T5 / Bart keep their blocks in two lists; the default layers are the larger list's (the decoder,
    with cross-attention), and the encoder runs inside 'pre': find_layers says so, naming the
    Config(layers) that takes both (a new user's review of transformers models found it silent)."""
    import warnings

    from fxshard.layers import find_layers

    class Stack(nn.Module):
        def __init__(self, width, cross):
            super().__init__()
            self.blocks = nn.ModuleList(nn.Linear(width, width * (2 if cross else 1)) for _ in range(2))

    class EncoderDecoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(16, 8)
            self.encoder, self.decoder = Stack(8, cross=False), Stack(8, cross=True)
    model = EncoderDecoder()
    with pytest.warns(UserWarning, match=r"the layers are decoder.blocks's children; encoder.blocks also holds blocks "
                                         r"\(144 parameters against 288\).*Config\(layers=\(\"encoder.blocks.\*\", "
                                         r"\"decoder.blocks.\*\"\)\) makes them layers too"):
        assert find_layers(model) == ["decoder.blocks.0", "decoder.blocks.1"]
    assert find_layers(model, ("encoder.blocks.*", "decoder.blocks.*")) == [
        "encoder.blocks.0", "encoder.blocks.1", "decoder.blocks.0", "decoder.blocks.1"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one list of blocks (a small one beside it is no encoder): nothing said
        model.encoder.blocks = nn.ModuleList(nn.Linear(8, 1) for _ in range(2))
        assert find_layers(model) == ["decoder.blocks.0", "decoder.blocks.1"]
