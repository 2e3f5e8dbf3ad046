"""Weights exchanged with Hugging Face transformers: GPT as Llama, MoEGPT as Mixtral, both ways."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import fxshard
from fxshard.launch import run_local
from fxshard.models import GPT, GPTConfig, MoEGPT, MoEGPTConfig
from fxshard.testing import torch_optimizer

transformers = pytest.importorskip("transformers")

ADAMW = fxshard.optim.AdamW(lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
MODELS = {"llama": (lambda: GPT(GPTConfig.preset("tiny")), "LlamaForCausalLM"),
          "mixtral": (lambda: MoEGPT(MoEGPTConfig.preset("tiny", d_ff_shared=None)), "MixtralForCausalLM")}


def batches(count=5, rows=4):
    generator = torch.Generator().manual_seed(0)
    return [{"idx": torch.randint(0, 64, (rows, 16), generator=generator),
             "tgt": torch.randint(0, 64, (rows, 16), generator=generator)} for _ in range(count)]


def shard(make, seed=0, mesh=None, config=None, batch=None):
    torch.manual_seed(seed)
    return fxshard.shard(make(), lambda m, b: m.loss(b), batch or batches()[0], ADAMW, mesh=mesh, config=config)


@pytest.mark.parametrize("name", list(MODELS))
def test_trained_weights_export_to_transformers_with_equal_logits_and_load_back(name, tmp_path):
    make, architecture = MODELS[name]
    step = shard(make)
    for batch in batches():
        step(batch)
    fxshard.export_hf(step, tmp_path)
    theirs = getattr(transformers, architecture).from_pretrained(tmp_path).eval()
    ours = make()
    ours.load_state_dict(step.parameters(), strict=False)
    with torch.no_grad():
        expected, got = ours(batches()[0]["idx"]), theirs(batches()[0]["idx"]).logits
    assert (got - expected).abs().max() <= 1e-5 * expected.abs().max()
    # and back into a step that started elsewhere: the same parameters, bit for bit
    other = shard(make, seed=1)
    fxshard.load_hf(other, tmp_path)
    before, after = step.parameters(), other.parameters()
    assert all(torch.equal(before[n], after[n]) for n in before)


def test_safetensors_in_the_models_own_names_load_and_bad_directories_are_refused(tmp_path):
    from safetensors.torch import save_file

    torch.manual_seed(3)
    source = GPT(GPTConfig.preset("tiny"))
    save_file({n: p.detach().contiguous() for n, p in source.named_parameters()}, str(tmp_path / "w.safetensors"))
    step = shard(MODELS["llama"][0])
    fxshard.load_hf(step, tmp_path)
    assert all(torch.equal(value, dict(source.named_parameters())[n]) for n, value in step.parameters().items())
    wrong = shard(lambda: GPT(GPTConfig.preset("tiny", d_ff=96)))
    with pytest.raises(fxshard.FxShardError, match=r"other shapes .* layers\.0\.mlp\.gate\.weight \(128, 64\) != "
                                                    r"\(96, 64\)"):
        fxshard.load_hf(wrong, tmp_path)
    with pytest.raises(fxshard.FxShardError, match=r"Mixtral, which cannot express a shared expert"):
        fxshard.export_hf(shard(lambda: MoEGPT(MoEGPTConfig.preset("tiny"))), tmp_path / "moe")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(fxshard.FxShardError, match="holds no"):
        fxshard.load_hf(step, empty)
    with pytest.raises(fxshard.FxShardError, match="is not a directory"):
        fxshard.load_hf(step, tmp_path / "w.safetensors")


def test_a_directory_with_an_index_reads_the_files_it_names_and_broken_files_are_named(tmp_path):
    """transformers reads the files model.safetensors.index.json maps the tensors to, whatever else the
    directory holds (Mistral's snapshots ship a consolidated.safetensors beside them); so does load_hf.
    Without an index a name in two files is ambiguous, and a file cut short is named."""
    import json

    from safetensors.torch import save_file

    torch.manual_seed(3)
    source = {n: p.detach().contiguous() for n, p in GPT(GPTConfig.preset("tiny")).named_parameters()}
    names = sorted(source)
    halves = {"a.safetensors": names[:len(names) // 2], "b.safetensors": names[len(names) // 2:]}
    for file, part in halves.items():
        save_file({n: source[n] for n in part}, str(tmp_path / file))
    save_file({"tok_embeddings.weight": torch.zeros(64, 64), names[0]: torch.zeros_like(source[names[0]])},
              str(tmp_path / "consolidated.safetensors"))
    index = {"weight_map": {n: file for file, part in halves.items() for n in part}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    step = shard(MODELS["llama"][0])
    fxshard.load_hf(step, tmp_path)
    assert all(torch.equal(value, source[n]) for n, value in step.parameters().items())
    (tmp_path / "model.safetensors.index.json").unlink()
    with pytest.raises(fxshard.FxShardError, match=f"'{names[0]}' is in both a.safetensors and consolidated"):
        fxshard.load_hf(step, tmp_path)
    (tmp_path / "consolidated.safetensors").unlink()
    data = (tmp_path / "b.safetensors").read_bytes()
    (tmp_path / "b.safetensors").write_bytes(data[:len(data) // 2])
    with pytest.raises(fxshard.FxShardError, match="b.safetensors is not a readable safetensors file"):
        fxshard.load_hf(step, tmp_path)
    (tmp_path / "b.safetensors").unlink()
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(fxshard.FxShardError, match="names files that are not in the directory: b.safetensors"):
        fxshard.load_hf(step, tmp_path)


def test_a_llama_directory_that_computes_something_else_is_refused(tmp_path):
    """A Llama with attention biases, another activation or norm epsilon would load its weights into this
    GPT and compute another function: refused by what config.json states and by the tensors left over."""
    import json

    from safetensors.torch import save_file

    step = shard(MODELS["llama"][0])
    fxshard.export_hf(step, tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    for change, message in (({"attention_bias": True}, r"attention_bias True \(this model: False\)"),
                            ({"hidden_act": "gelu"}, r"hidden_act 'gelu'"),
                            ({"rms_norm_eps": 1e-2}, r"rms_norm_eps 0\.01")):
        (tmp_path / "config.json").write_text(json.dumps({**written, **change}))
        with pytest.raises(fxshard.FxShardError, match=f"computes another function than this GPT as Llama: {message}"):
            fxshard.load_hf(step, tmp_path)
    # older hub configs state neither key/value heads nor head_dim: transformers' defaults follow the head count
    fewer_keys = {k: v for k, v in written.items() if k not in ("num_key_value_heads", "head_dim")}
    (tmp_path / "config.json").write_text(json.dumps({**fewer_keys, "num_attention_heads": 8}))
    with pytest.raises(fxshard.FxShardError, match=r"num_attention_heads 8 \(this model: 4\)"):
        fxshard.load_hf(step, tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(fewer_keys))
    fxshard.load_hf(step, tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(written))
    save_file({"model.layers.0.self_attn.q_proj.bias": torch.zeros(64)}, str(tmp_path / "extra.safetensors"))
    with pytest.raises(fxshard.FxShardError, match=r"1 tensors this GPT has no place for .*q_proj\.bias"):
        fxshard.load_hf(step, tmp_path)


def test_an_export_states_the_dtype_its_file_holds(tmp_path):
    import json

    for dtype, name in ((torch.float32, "float32"), (torch.bfloat16, "bfloat16")):
        step = shard(lambda: GPT(GPTConfig.preset("tiny")).to(dtype))
        fxshard.export_hf(step, tmp_path / name)
        assert json.loads((tmp_path / name / "config.json").read_text())["dtype"] == name


def test_an_export_cut_short_leaves_the_files_it_replaces_whole(tmp_path, monkeypatch):
    import safetensors.torch

    step = shard(MODELS["llama"][0])
    fxshard.export_hf(step, tmp_path)
    before = {name: (tmp_path / name).read_bytes() for name in ("model.safetensors", "config.json")}

    def dies_while_writing(tensors, path, metadata=None):  # as safetensors fails: not an OSError
        with open(path, "wb") as handle:
            handle.write(b"half a file")
        raise safetensors.SafetensorError("I/O error: No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", dies_while_writing)
    step(batches()[0])
    with pytest.raises(fxshard.FxShardError, match=r"cannot be written \(SafetensorError: I/O error: No space left"):
        fxshard.export_hf(step, tmp_path)
    assert {name: (tmp_path / name).read_bytes() for name in before} == before


def llama_config():
    cfg = GPTConfig.preset("tiny")
    return transformers.LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.d_ff,
                                    num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_head,
                                    rms_norm_eps=cfg.norm_eps, tie_word_embeddings=False,
                                    rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta})


def zero3_job(directory: str) -> tuple[list[float], str, str]:
    """The losses of training from the directory; then a NaN put where only rank 1 reads (a parameter
    held whole in its ZeRO-3 shard): every rank must refuse it and keep its state."""
    from safetensors.torch import save_file

    from fxshard.checkpoint.state import pieces_of

    rank = dist.get_rank()
    local = [{k: v[rank * 2:(rank + 1) * 2] for k, v in b.items()} for b in batches()]
    step = shard(MODELS["llama"][0], seed=7, mesh=fxshard.Mesh(dp=2),
                 config=fxshard.Config(sharding="optim_grads_params"), batch=local[0])
    fxshard.load_hf(step, directory)
    losses = [step(batch)["loss"].item() for batch in local]

    held = [None, None]
    dist.all_gather_object(held, {piece.key.removeprefix("model.") for piece in pieces_of(step)})
    poisoned = sorted(held[1] - held[0])[0]
    before = step.parameters()
    if rank == 0:
        save_file({name: torch.full_like(value, float("nan")) if name == poisoned else value.contiguous()
                   for name, value in before.items()}, os.path.join(directory, "own", "model.safetensors"))
    dist.barrier()
    try:
        fxshard.load_hf(step, os.path.join(directory, "own"))
        refused = ""
    except fxshard.FxShardError as error:
        refused = str(error)
    assert all(torch.equal(value, before[name]) for name, value in step.parameters().items())
    return losses, poisoned, refused


def test_a_transformers_llama_checkpoint_trains_under_dp2_zero3_like_the_llama_in_eager(tmp_path):
    torch.manual_seed(0)
    llama = transformers.LlamaForCausalLM(llama_config())
    llama.save_pretrained(tmp_path)
    (tmp_path / "own").mkdir()
    (losses, poisoned, refused), (_, _, refused_too) = run_local(zero3_job, 2, str(tmp_path), backend="gloo")
    assert f"not finite (NaN or inf) in model.{poisoned} (in the part this rank reads)" in refused_too
    assert refused.startswith("load_hf: another rank could not load") and poisoned in refused
    optimizer = torch_optimizer(ADAMW, llama.parameters())
    for ours, batch in zip(losses, batches()):
        optimizer.zero_grad()
        logits = llama(batch["idx"]).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), batch["tgt"].flatten())
        loss.backward()
        optimizer.step()
        assert abs(ours - loss.item()) <= 1e-5 * loss.item(), (ours, loss.item())
    assert os.path.exists(tmp_path / "config.json")


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_a_transformers_moe_loads_its_hub_checkpoint_with_experts_stored_one_by_one(name, tmp_path):
    """transformers' MoE modules hold their experts fused (experts.gate_up_proj [E, 2F, D]) while
    save_pretrained writes them one by one (Mixtral's block_sparse_moe.experts.<e>.w1/w3/w2): load_hf maps
    them by transformers' own conversion for the model type, as from_pretrained does. A directory whose
    config.json states another head count or rope theta (same shapes, another function) is refused."""
    import json

    from model_zoo import build

    source = build(name, seed=0)
    source.save_pretrained(tmp_path)
    step = fxshard.shard(build(name, seed=1), lambda m, b: m(**b).loss,
                         {"input_ids": torch.randint(0, 64, (2, 8)), "labels": torch.randint(0, 64, (2, 8))}, ADAMW)
    fxshard.load_hf(step, tmp_path)
    loaded, want = step.parameters(), dict(source.named_parameters())
    assert sorted(loaded) == sorted(want) and all(torch.equal(loaded[n], want[n]) for n in want)
    written = json.loads((tmp_path / "config.json").read_text())
    for change, message in (({"num_attention_heads": 8, "head_dim": 8}, r"num_attention_heads 8 \(this model: 4\)"),
                            ({"rope_parameters": {"rope_type": "default", "rope_theta": 123.0}}, "rope_parameters")):
        (tmp_path / "config.json").write_text(json.dumps({**written, **change}))
        with pytest.raises(fxshard.FxShardError, match=f"computes another function than this {name} model: .*{message}"):
            fxshard.load_hf(step, tmp_path)
    # what does not change the function loads: head_dim left to its default (hidden / heads, as the
    # hub's Mixtral-8x7B states it), another auxiliary-loss weight (a training choice)
    unstated = {k: v for k, v in written.items() if k != "head_dim"}
    (tmp_path / "config.json").write_text(json.dumps({**unstated, "router_aux_loss_coef": 0.5}))
    fxshard.load_hf(step, tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(written))
    from safetensors.torch import load_file, save_file

    (file,) = tmp_path.glob("*.safetensors")
    tensors = load_file(file)
    last = max(k for k in tensors if ".experts.3." in k and "layers.0." in k)  # one matrix of the last expert
    save_file({k: v for k, v in tensors.items() if k != last}, str(file), {"format": "pt"})
    with pytest.raises(fxshard.FxShardError, match=r"lacks experts \[3\] \(of 4\): the checkpoint is incomplete"):
        fxshard.load_hf(step, tmp_path)


def test_a_models_persistent_buffers_load_with_its_parameters(tmp_path):
    """Buffers the directory holds under the model's names load too (DeepSeek-V3's router score bias
    routes every token: left as initialized, the model computed another function)."""
    from safetensors.torch import save_file

    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(4, 4)
            self.register_buffer("bias_score", torch.zeros(4))

        def forward(self, x):
            return (self.linear(x) + self.bias_score).square().mean()

    step = fxshard.shard(Scaled(), lambda m, b: m(b["x"]), {"x": torch.randn(3, 4)}, ADAMW)
    saved = {"linear.weight": torch.randn(4, 4), "linear.bias": torch.randn(4), "bias_score": torch.arange(4.0)}
    save_file(saved, str(tmp_path / "w.safetensors"))
    fxshard.load_hf(step, tmp_path)
    assert torch.equal(step.buffers()["bias_score"], saved["bias_score"])
    assert torch.equal(step.parameters()["linear.weight"], saved["linear.weight"])


def test_a_directory_in_another_layout_than_the_models_own_names_says_which_names_do_not_match(tmp_path):
    from safetensors.torch import save_file

    class Fused(torch.nn.Module):  # experts held fused, as transformers' MoE modules hold them
        def __init__(self):
            super().__init__()
            self.gate_up_proj = torch.nn.Parameter(torch.randn(2, 8, 4))

        def forward(self, x):
            return torch.einsum("td,efd->tef", x, self.gate_up_proj).square().mean()

    step = fxshard.shard(Fused(), lambda m, b: m(b["x"]), {"x": torch.randn(3, 4)}, ADAMW)
    save_file({f"experts.{e}.gate_proj.weight": torch.zeros(4, 4) for e in range(2)}, str(tmp_path / "w.safetensors"))
    with pytest.raises(fxshard.FxShardError, match=r"1 are not there \(e\.g\. gate_up_proj\) and 2 tensors there are "
                                                   r"none of them \(e\.g\. experts\.0\.gate_proj\.weight"):
        fxshard.load_hf(step, tmp_path)


def test_transformers_directories_load_exactly_or_are_refused_with_the_cause(tmp_path):
    """A review of weights exchanged with 17 transformers architectures: every config key that changes
    what the model computes is compared (GPT-2's activation_function was not: a directory of another
    function loaded silently); tensors the model has no place for are refused; GPT-NeoX's own
    save_pretrained loads through its class's conversion (embed_out -> lm_head); an incomplete directory
    and pickled weights are named as such; a first evaluate() under inference_mode traces the same step."""
    import json

    import transformers

    def gpt2(**changes):
        torch.manual_seed(0)
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2, **changes))
    batch = {"input_ids": torch.randint(0, 64, (2, 8)), "labels": torch.randint(0, 64, (2, 8))}

    def loss(model, batch):
        return model(**batch, use_cache=False).loss
    gpt2(activation_function="relu").save_pretrained(tmp_path / "relu")
    step = fxshard.shard(gpt2(), loss, batch, ADAMW)
    with pytest.raises(fxshard.FxShardError, match=r"computes another function than this gpt2 model: activation_function "
                                                   r"'relu' \(this model: 'gelu_new'\).*check_config=False"):
        fxshard.load_hf(step, tmp_path / "relu")
    fxshard.load_hf(step, tmp_path / "relu", check_config=False)  # meant: the same weights, another activation
    assert torch.equal(step.parameters()["transformer.h.0.mlp.c_fc.weight"],
                       gpt2(activation_function="relu").state_dict()["transformer.h.0.mlp.c_fc.weight"])

    def llama(**changes):
        torch.manual_seed(0)
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(
            **{**dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1), **changes}))
    llama(attention_bias=True).save_pretrained(tmp_path / "biased")
    os.remove(tmp_path / "biased" / "config.json")  # no config to compare: the tensors say it
    with pytest.raises(fxshard.FxShardError, match=r"holds 4 tensors this LlamaForCausalLM has no place for \(e\.g\. "
                                                   r"model\.layers\.0\.self_attn\.k_proj\.bias"):
        fxshard.load_hf(fxshard.shard(llama(), loss, batch, ADAMW), tmp_path / "biased")

    torch.manual_seed(0)
    neox = transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2))
    neox.save_pretrained(tmp_path / "neox")
    with torch.device("meta"):
        empty = transformers.GPTNeoXForCausalLM(neox.config)
    step = fxshard.shard(empty, loss, batch, ADAMW)
    fxshard.load_hf(step, tmp_path / "neox")
    assert all(torch.equal(step.parameters()[name], value) for name, value in neox.named_parameters())

    files = tmp_path / "biased"
    with open(files / "model.safetensors", "rb") as handle:
        from safetensors.torch import load, save_file
        tensors = load(handle.read())
    save_file({k: v for k, v in tensors.items() if "mlp" not in k and "bias" not in k}, str(files / "model.safetensors"))
    with pytest.raises(fxshard.FxShardError, match=r"lacks 3 of this LlamaForCausalLM's tensors .* it is incomplete"):
        fxshard.load_hf(fxshard.shard(llama(), loss, batch, ADAMW), files)
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    torch.save({}, pickled / "pytorch_model.bin")
    (pickled / "config.json").write_text(json.dumps({}))
    with pytest.raises(fxshard.FxShardError, match=r"only pickled weights \(pytorch_model\.bin\), which fxshard does not "
                                                   r"read: load them with from_pretrained"):
        fxshard.load_hf(step, pickled)
    with torch.inference_mode():
        assert torch.isfinite(step.evaluate(batch)["loss"])
        built_there = fxshard.shard(llama(), loss, batch, ADAMW)  # its state trains outside inference mode
    assert torch.isfinite(built_there(batch)["loss"])

    # not refused (a second review): what from_pretrained skips too (GPT-2's old attention-mask buffers),
    # the other name of a tied weight written beside it, and a model cut down on purpose (check_config=False)
    gpt2().save_pretrained(tmp_path / "masks")
    tensors = load((tmp_path / "masks" / "model.safetensors").read_bytes())
    save_file({**tensors, "transformer.h.0.attn.bias": torch.ones(1, 1, 16, 16),
               "lm_head.weight": tensors["transformer.wte.weight"].clone()}, str(tmp_path / "masks" / "model.safetensors"))
    step = fxshard.shard(gpt2(), loss, batch, ADAMW)
    fxshard.load_hf(step, tmp_path / "masks")
    llama(num_hidden_layers=2).save_pretrained(tmp_path / "deeper")
    with pytest.raises(fxshard.FxShardError, match=r"num_hidden_layers 2 \(this model: 1\)"):
        fxshard.load_hf(fxshard.shard(llama(), loss, batch, ADAMW), tmp_path / "deeper")
    with pytest.warns(UserWarning, match=r"holds 9 tensors this LlamaForCausalLM has no place for .* left out"):
        fxshard.load_hf(fxshard.shard(llama(), loss, batch, ADAMW), tmp_path / "deeper", check_config=False)
