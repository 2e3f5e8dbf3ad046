"""Weights to and from Hugging Face: `export_hf(step, dir)` writes safetensors and a config.json that
transformers loads; `load_hf(step, dir)` initializes a step's parameters from such a directory (or
from safetensors in the model's own parameter names), each rank reading only its pieces.

Architectures, and why:
- `models.GPT` is `LlamaForCausalLM`: RMSNorm, SwiGLU, RoPE in the two-halves (GPT-NeoX) layout that
  transformers' Llama uses, so q and k need no permutation; the fused qkv rows split into q_proj,
  k_proj, v_proj; no biases, untied head.
- `models.MoEGPT` is `MixtralForCausalLM` (its hub layout, the one transformers' save_pretrained
  writes: block_sparse_moe.experts.<e>.w1/w3/w2): Mixtral routes as MoEGPT does (softmax over the
  experts, top-k, the k weights renormalized) with SwiGLU experts, Llama attention and no bias. No
  transformers architecture has MoEGPT's shared expert (Qwen2-MoE gates its shared expert with a
  sigmoid, which cannot be the identity), so a model with `d_ff_shared` is refused, as are
  `normalize_top_k=False` and `routing="balanced"`. Mixtral is dropless: a model trained with a
  capacity factor exports the same weights but transformers computes without drops.

A target tensor is described as a `Source` tree (stored tensors, concatenated along a dim, stacked),
so any rectangle of it reads only the stored elements it covers (`safe_open(...).get_slice`).
"""

from __future__ import annotations

import fnmatch
import json
import math
import os
import re
import warnings
from dataclasses import dataclass

import torch

from ..errors import FxShardError
from .experts import ExpertLayout, convert_expert_tensors
from ..program import InputKind
from ..runtime.agreement import raise_together
from .dcp import path_argument, require_step
from .items import model_key
from .state import load_state_dict_into, pieces_of, read_box

PLAIN = ExpertLayout("grouped", None)


# ---- tensors as trees over stored tensors ------------------------------------------------------
class Source:
    shape: tuple[int, ...]

    def read(self, offsets, sizes) -> torch.Tensor:
        raise NotImplementedError


@dataclass
class Stored(Source):
    """A tensor in a safetensors file, read a rectangle at a time."""

    files: "SafetensorsDirectory"
    name: str
    shape: tuple[int, ...]

    def read(self, offsets, sizes):
        part = self.files.slice(self.name)
        return part[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))] if sizes else part[:]


@dataclass
class Held(Source):
    """A tensor in memory (exports, and expert layers converted whole)."""

    tensor: torch.Tensor

    @property
    def shape(self):
        return tuple(self.tensor.shape)

    def read(self, offsets, sizes):
        return read_box(self.tensor, offsets, sizes)


@dataclass
class Cat(Source):
    """`parts` concatenated along `dim`."""

    parts: list[Source]
    dim: int

    @property
    def shape(self):
        first = self.parts[0].shape
        return (*first[:self.dim], sum(p.shape[self.dim] for p in self.parts), *first[self.dim + 1:])

    def read(self, offsets, sizes):
        pieces, begin = [], 0
        low, high = offsets[self.dim], offsets[self.dim] + sizes[self.dim]
        for part in self.parts:
            end = begin + part.shape[self.dim]
            if begin < high and low < end:
                start, stop = max(low, begin), min(high, end)
                o, s = list(offsets), list(sizes)
                o[self.dim], s[self.dim] = start - begin, stop - start
                pieces.append(part.read(o, s))
            begin = end
        return torch.cat(pieces, dim=self.dim)


@dataclass
class Stack(Source):
    """`parts` stacked along a new dim 0 (experts)."""

    parts: list[Source]

    @property
    def shape(self):
        return (len(self.parts), *self.parts[0].shape)

    def read(self, offsets, sizes):
        return torch.stack([self.parts[e].read(offsets[1:], sizes[1:])
                            for e in range(offsets[0], offsets[0] + sizes[0])])


class SafetensorsDirectory:
    """Every tensor of a directory's safetensors files, opened lazily: the files its index
    (`model.safetensors.index.json`, as transformers writes it) maps the tensors to where it has
    one, which is what transformers reads too (a hub snapshot may hold other files beside it, e.g.
    Mistral's `consolidated.safetensors`); else every *.safetensors file, no name in two of them."""

    INDEX = "model.safetensors.index.json"

    def __init__(self, directory: str):
        if not os.path.isdir(directory):
            raise FxShardError(f"{directory} is not a directory; pass a directory written by save_pretrained or "
                               f"fxshard.export_hf")
        self.directory, self.handles, self.where, self.shapes = directory, {}, {}, {}
        index = self._index(directory)
        files = sorted(set(index.values())) if index else sorted(
            f for f in os.listdir(directory) if f.endswith(".safetensors"))
        if not files:
            pickled = [f for f in os.listdir(directory) if f.endswith((".bin", ".pt", ".pth"))]
            raise FxShardError(f"{directory} holds no *.safetensors files"
                               + (f", only pickled weights ({', '.join(pickled[:3])}), which fxshard does not read: load "
                                  f"them with from_pretrained and pass that model to shard (or save_pretrained it "
                                  f"again, which writes safetensors)" if pickled else
                                  "; pass a directory written by save_pretrained or fxshard.export_hf"))
        for file in files:
            handle = self._open(directory, file)
            self.handles[file] = handle
            for name in handle.keys():
                if index and index.get(name) != file:  # the index names another file for it, or none
                    continue
                if name in self.where:
                    raise FxShardError(f"{directory}: {name!r} is in both {self.where[name]} and {file}, and no "
                                       f"{self.INDEX} says which to read; remove one of the files")
                self.where[name] = file
                self.shapes[name] = tuple(handle.get_slice(name).get_shape())
        absent = sorted(name for name in index if name not in self.where)
        if absent:
            raise FxShardError(f"{directory}: {self.INDEX} maps {len(absent)} tensors to files that do not hold them "
                               f"(e.g. {absent[0]!r} in {index[absent[0]]}); the directory is incomplete: "
                               f"download or copy it again")

    @classmethod
    def _index(cls, directory: str) -> dict[str, str]:
        """Tensor name -> file from the directory's index, or {} where it has none."""
        path = os.path.join(directory, cls.INDEX)
        if not os.path.exists(path):
            return {}
        try:
            with open(path) as handle:
                weight_map = json.load(handle)["weight_map"]
            if not all(isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
                raise TypeError("its names and files must be strings")
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
            raise FxShardError(f"{path} is not a safetensors index (a JSON object whose 'weight_map' maps tensor "
                               f"names to files): {type(error).__name__}: {error}; remove it or write it "
                               f"again") from None
        missing = sorted({f for f in weight_map.values() if not os.path.isfile(os.path.join(directory, f))})
        if missing:
            raise FxShardError(f"{path} names files that are not in the directory: {', '.join(missing[:4])}; the "
                               f"download or copy is incomplete")
        return weight_map

    @staticmethod
    def _open(directory: str, file: str):
        from safetensors import SafetensorError, safe_open

        try:
            return safe_open(os.path.join(directory, file), framework="pt")
        except (SafetensorError, OSError) as error:
            raise FxShardError(f"{os.path.join(directory, file)} is not a readable safetensors file ({error}): it "
                               f"may be cut short or corrupt; write or copy it again") from None

    def slice(self, name: str):
        return self.handles[self.where[name]].get_slice(name)

    def source(self, name: str) -> Stored:
        return Stored(self, name, self.shapes[name])


# ---- the architectures -------------------------------------------------------------------------
def _layers(names) -> int:
    return 1 + max((int(m.group(1)) for n in names if (m := re.match(r"layers\.(\d+)\.", n))), default=-1)


HUB_ARCHITECTURES = {"GPT": "Llama", "MoEGPT": "Mixtral"}  # fxshard.models class -> what it exchanges as


def hf_layout(model_class: str, cfg, names: set[str]) -> tuple[dict, dict[str, list[str]]]:
    """(config.json, our parameter name -> the HF names it is made of, in order) for a known model."""
    if model_class not in HUB_ARCHITECTURES or cfg is None:
        raise FxShardError(f"export_hf / load_hf know fxshard.models.GPT (as Llama) and MoEGPT (as Mixtral), not "
                           f"{model_class}; for another model, load safetensors in its own parameter names")
    layers = _layers(names)
    common = {"vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model, "num_hidden_layers": layers,
              "num_attention_heads": cfg.n_head, "num_key_value_heads": cfg.n_head, "hidden_act": "silu",
              "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta,
              "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
              "max_position_embeddings": 4096, "tie_word_embeddings": False, "attention_bias": False,
              "dtype": "float32"}
    parts = {"tok_emb.weight": ["model.embed_tokens.weight"], "norm.weight": ["model.norm.weight"],
             "head.weight": ["lm_head.weight"]}
    for i in range(layers):
        ours, theirs = f"layers.{i}.", f"model.layers.{i}."
        parts[ours + "attn_norm.weight"] = [theirs + "input_layernorm.weight"]
        parts[ours + "mlp_norm.weight"] = [theirs + "post_attention_layernorm.weight"]
        parts[ours + "attn.qkv.weight"] = [theirs + f"self_attn.{p}_proj.weight" for p in "qkv"]
        parts[ours + "attn.proj.weight"] = [theirs + "self_attn.o_proj.weight"]
        if model_class == "GPT":
            for mine, hf in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
                parts[ours + f"mlp.{mine}.weight"] = [theirs + f"mlp.{hf}.weight"]
        else:
            moe = theirs + "block_sparse_moe."
            parts[ours + "moe.router.weight"] = [moe + "gate.weight"]
            parts[ours + "moe.experts.fc1."] = [moe + f"experts.{e}.{w}.weight" for e in range(cfg.n_expert)
                                                for w in ("w1", "w3")]
            parts[ours + "moe.experts.fc2."] = [moe + f"experts.{e}.w2.weight" for e in range(cfg.n_expert)]
    if model_class == "GPT":
        return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "intermediate_size": cfg.d_ff,
                **common}, parts
    refused = [reason for reason, bad in (("a shared expert (d_ff_shared)", cfg.d_ff_shared),
                                          ("normalize_top_k=False", not cfg.normalize_top_k),
                                          ("routing='balanced'", cfg.routing != "learned")) if bad]
    if refused:
        raise FxShardError(f"MoEGPT exports as Mixtral, which cannot express {' or '.join(refused)}; train with "
                           f"MoEGPTConfig(d_ff_shared=None, normalize_top_k=True, routing='learned') to exchange "
                           f"weights with transformers")
    return {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "intermediate_size": cfg.d_ff_expert,
            "num_local_experts": cfg.n_expert, "num_experts_per_tok": cfg.top_k,
            "router_aux_loss_coef": cfg.aux_loss_coef, "sliding_window": None, **common}, parts


def _expert_sources(prefix: str, hf: list[str], get, experts: int) -> dict[str, Source]:
    """Our grouped, plain-row fc1 / fc2 of one MoE layer from Mixtral's per-expert w1/w3/w2."""
    if prefix.endswith("fc1."):  # [E, 2F, D]: gate rows (w1), then up rows (w3)
        return {"weight": Stack([Cat([get(hf[2 * e]), get(hf[2 * e + 1])], 0) for e in range(experts)])}
    return {"weight": Stack([get(hf[e]) for e in range(experts)])}


# ---- export ------------------------------------------------------------------------------------
def export_hf(step, directory: str | os.PathLike) -> None:
    """Write `step`'s current weights as a Hugging Face checkpoint (model.safetensors, config.json)
    that `transformers.AutoModelForCausalLM.from_pretrained(directory)` loads. Every rank calls it
    (the parameters are gathered); the last rank writes, each file beside its place and renamed over
    it, so an export cut short leaves no half-written file."""
    import torch.distributed as dist
    from safetensors.torch import save_file

    require_step(step, "export_hf")
    directory = os.fspath(path_argument(directory, "export_hf"))
    params = step.parameters()
    config, parts = hf_layout(step.model_class, step.model_config, set(params))
    params = _expert_layers_as(step, params, PLAIN)
    tensors = {}
    for ours, hf in parts.items():
        if ours.endswith("."):  # an expert layer: E experts' per-expert matrices
            weight = params[ours + "weight"]
            if ours.endswith("fc1."):
                half = weight.shape[1] // 2
                tensors.update({hf[2 * e]: weight[e, :half] for e in range(weight.shape[0])})
                tensors.update({hf[2 * e + 1]: weight[e, half:] for e in range(weight.shape[0])})
            else:
                tensors.update({hf[e]: weight[e] for e in range(weight.shape[0])})
        else:
            tensors.update(zip(hf, params[ours].chunk(len(hf), dim=0)))
    left = set(params) - {n for n in parts} - {o + "weight" for o in parts if o.endswith(".")}
    if left:
        raise FxShardError(f"export_hf: parameters {sorted(left)[:6]} have no place in {config['architectures'][0]}")
    dtypes = {value.dtype for value in tensors.values()}  # what the file holds: one dtype, or float32 as written
    if len(dtypes) == 1:
        config["dtype"] = str(next(iter(dtypes))).removeprefix("torch.")  # transformers >= 4.56 (torch_dtype before)
    writer = not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == dist.get_world_size() - 1
    problem = None
    if writer:
        try:
            os.makedirs(directory, exist_ok=True)
            cpu = {name: value.detach().to("cpu", copy=True).contiguous() for name, value in tensors.items()}
            _replace_file(os.path.join(directory, "model.safetensors"),
                          lambda path: save_file(cpu, path, {"format": "pt"}))
            _replace_file(os.path.join(directory, "config.json"), lambda path: _write_json(config, path))
        except Exception as error:  # noqa: BLE001  every rank learns it (none waits for a failed writer)
            said = getattr(error, "strerror", None) or str(error).strip().splitlines()[0][:200]
            problem = (f"export_hf: {directory} cannot be written ({type(error).__name__}: {said}); choose a "
                       f"directory this process can write, with room for the weights")
    raise_together(problem, step.device, f"export_hf: the writing rank could not write {directory}",
                   getattr(step, "job_group", None))


def _replace_file(path: str, write) -> None:
    """`write(temporary)` then rename it to `path`: a killed export leaves the file it replaces whole,
    never half written."""
    temporary = f"{path}.partial"
    write(temporary)
    with open(temporary, "rb") as handle:
        os.fsync(handle.fileno())
    os.replace(temporary, path)


def _write_json(value, path: str) -> None:
    with open(path, "w") as handle:
        json.dump(value, handle, indent=1)


def _expert_layers_as(step, params: dict, target: ExpertLayout) -> dict:
    """`params` with every expert layer (any storage layout) converted to `target`'s keys and rows."""
    params = dict(params)
    for prefix, (layout, experts) in step.expert_layouts.items():
        own = {n[len(prefix):]: params.pop(n) for n in list(params)
               if n.startswith(prefix) and "." not in n[len(prefix):]}
        converted = convert_expert_tensors(own, layout, target, experts, prefix)
        params.update({prefix + rel: value for rel, value in converted.items()})
    return params


# ---- import ------------------------------------------------------------------------------------
def load_hf(step, directory: str | os.PathLike, check_config: bool = True) -> None:
    """Initialize `step`'s parameters from a Hugging Face directory (Llama for models.GPT, Mixtral for
    models.MoEGPT) or from safetensors files in the model's own parameter names. Each rank reads only
    the rectangles of each tensor it holds; optimizer state and the step count are left as they are
    (a fresh step: zeros and 0). Every rank calls it; nothing changes unless every tensor is found and
    finite, and when one rank's pieces are not (a NaN, a file cut short where only it reads), every rank
    raises. A transformers model's directory must state the model's own config (what it computes);
    `check_config=False` loads weights into a model whose config was changed on purpose (another rope
    scaling for a longer context)."""
    if not isinstance(check_config, bool):
        raise FxShardError(f"load_hf(check_config=...) must be True or False, got {check_config!r}")
    require_step(step, "load_hf")
    directory = os.fspath(path_argument(directory, "load_hf"))
    step._refuse_if_aborted()
    problem, staged = None, {}
    try:
        staged = _staged(step, directory, check_config)
    except FxShardError as error:
        problem = str(error)
    raise_together(problem, step.device, f"load_hf: another rank could not load {directory}; nothing was loaded",
                   getattr(step, "job_group", None))
    with torch.no_grad():
        for key, value in staged.items():
            step.state[key].copy_(value)


def _staged(step, directory: str, check_config: bool = True) -> dict:
    """Copies of this rank's state tensors that the directory holds, filled from it (buffers the directory
    does not hold stay as they are); FxShardError for anything missing, unreadable or not finite."""
    files = SafetensorsDirectory(directory)
    shapes = {spec.name: tuple(spec.shape) for spec in step.programs[0].inputs if spec.kind is InputKind.PARAM}
    buffers = {spec.name: tuple(spec.shape) for spec in step.programs[0].inputs if spec.kind is InputKind.BUFFER}
    sources = {model_key(name): source
               for name, source in _sources(step, files, shapes, directory, buffers, check_config).items()}
    pieces = [piece for piece in pieces_of(step) if piece.key in sources]
    staged = {piece.state: step.state[piece.state].clone() for piece in pieces}
    load_state_dict_into(step, sources, staged)
    not_finite = sorted({piece.key for piece in pieces if staged[piece.state].is_floating_point() and not bool(
        torch.isfinite(staged[piece.state].view(-1)[piece.local:piece.local + piece.numel]).all())})
    if not_finite:
        raise FxShardError(
            f"load_hf: {directory} holds values that are not finite (NaN or inf) in {', '.join(not_finite[:8])}"
            f"{', ...' if len(not_finite) > 8 else ''} (in the part this rank reads); nothing was loaded. Repair or "
            f"re-export the checkpoint")
    return staged


def _sources(step, files: SafetensorsDirectory, shapes: dict, directory: str, buffers: dict,
             check_config: bool = True) -> dict[str, Source]:
    """Our parameter name -> where its global tensor comes from, checked against its shape; and the
    buffers (`buffers`: name -> shape) the directory holds under the names the parameters are found
    by (a transformers model's persistent buffers, e.g. DeepSeek-V3's router score bias)."""
    if step.hf_config is not None and check_config:  # a transformers model: config.json must compute the same
        _check_transformers_config(step.hf_config, directory)
    converted = None
    if all(name in files.shapes for name in shapes):  # the model's own names
        _refuse_unplaced(step, directory, set(files.shapes) - set(shapes) - set(buffers), check_config)
        sources = {name: files.source(name) for name in [*shapes, *buffers] if name in files.shapes}
    elif step.hf_config is not None and (converted := _transformers_layout(
            step.model_class, step.hf_config["model_type"], files)) \
            and all(name in converted for name in shapes):  # experts stored one by one, fused in the model
        _refuse_unplaced(step, directory, set(converted) - set(shapes) - set(buffers), check_config)
        sources = {name: converted[name] for name in [*shapes, *buffers] if name in converted}
    elif step.model_class not in HUB_ARCHITECTURES:  # no Hugging Face layout to map: say what does not match
        lacking = sorted(set(shapes) - set(files.shapes))
        spare = sorted(set(files.shapes) - set(shapes))
        still = sorted(set(shapes) - set(converted or {}))
        mapped = (f"; through transformers' conversion for model_type {step.hf_config['model_type']!r}, {len(still)} "
                  f"are still not there (e.g. {', '.join(still[:3])})" if converted else "")
        if not spare:  # nothing under other names: files are missing, not another layout
            raise FxShardError(f"{directory} lacks {len(lacking)} of this {step.model_class}'s tensors (e.g. "
                               f"{', '.join(lacking[:3])}) and holds none under other names: it is incomplete (a "
                               f"shard file missing, a download cut short); copy or download it again")
        raise FxShardError(f"{directory} does not hold this {step.model_class}'s parameters under their own names: "
                           f"{len(lacking)} are not there (e.g. {', '.join(lacking[:3])}) and {len(spare)} tensors there "
                           f"are none of them (e.g. {', '.join(spare[:3])}){mapped}. transformers' save_pretrained "
                           f"writes some models in another layout than their modules hold; load such a directory with "
                           f"from_pretrained and pass that model to shard, or save with fxshard.export_hf / "
                           f"safetensors in the parameters' own names")
    else:
        config_file = os.path.join(directory, "config.json")
        theirs = {}
        if os.path.exists(config_file):
            with open(config_file) as handle:
                try:
                    theirs = json.load(handle)
                except json.JSONDecodeError as error:
                    raise FxShardError(f"{config_file} is not JSON ({error}); fix or remove it") from None
            if not isinstance(theirs, dict):
                raise FxShardError(f"{config_file} holds {type(theirs).__name__}, not a model config object; fix or "
                                   f"remove it")
        architecture = (theirs.get("architectures") or [None])[0]
        ours, parts = hf_layout(step.model_class, step.model_config, set(shapes))
        differences = _config_differences(theirs, ours, step.model_config)
        if differences:
            raise FxShardError(f"{directory} ({architecture or 'no architecture'}) computes another function than this "
                               f"{step.model_class} as {HUB_ARCHITECTURES[step.model_class]}: "
                               f"{'; '.join(differences)}. Its weights would load and compute something else; build "
                               f"a model that has these features")
        used = {hf for names in parts.values() for hf in names}
        unused = sorted(set(files.shapes) - used)
        if unused:
            raise FxShardError(f"{directory} holds {len(unused)} tensors this {step.model_class} has no place for (e.g. "
                               f"{', '.join(unused[:4])}): the model they come from computes more than this one")
        missing = sorted(used - set(files.shapes))
        if missing:
            own = sorted(set(shapes) - set(files.shapes))
            raise FxShardError(f"{directory} ({architecture or 'no config.json'}) lacks {len(missing)} tensors this "
                               f"{step.model_class} needs as {HUB_ARCHITECTURES[step.model_class]} "
                               f"(e.g. {', '.join(missing[:4])}), and {len(own)} of its own parameter names (e.g. "
                               f"{', '.join(own[:4])})")
        get = files.source
        sources = {}
        for ours, hf in parts.items():
            if ours.endswith("."):
                experts = step.model_config.n_expert
                for rel, source in _expert_sources(ours, hf, get, experts).items():
                    sources[ours + rel] = source
            else:
                sources[ours] = Cat([get(n) for n in hf], 0) if len(hf) > 1 else get(hf[0])
        sources = _expert_sources_as_stored(step, sources)
    expected = {**buffers, **shapes}
    wrong = [f"{n} {tuple(s.shape)} != {expected[n]}" for n, s in sources.items()
             if n in expected and tuple(s.shape) != expected[n]]
    if wrong:
        raise FxShardError(f"{directory}: tensors of other shapes than this model's: {', '.join(wrong[:6])}; "
                           f"build the model with the checkpoint's config")
    return sources


# a transformers config's keys that change nothing a training step computes from given weights:
# bookkeeping, generation and tokenizer settings, initialization, and training choices (dropout, the
# auxiliary losses' weights). Every other key the two configs both hold must agree (load_hf).
NOT_COMPUTED = frozenset((
    "transformers_version", "architectures", "_name_or_path", "name_or_path", "torch_dtype", "dtype", "auto_map",
    "_commit_hash", "_attn_implementation", "_attn_implementation_autoset", "attn_implementation",
    "_experts_implementation", "experts_implementation", "id2label", "label2id", "problem_type", "finetuning_task",
    "return_dict", "use_return_dict", "output_hidden_states", "output_attentions", "output_router_logits",
    "use_cache", "torchscript", "pruned_heads", "tf_legacy_loss", "use_bfloat16", "tokenizer_class", "prefix",
    "task_specific_params", "initializer_range", "initializer_factor", "gradient_checkpointing",
    "chunk_size_feed_forward", "max_length", "min_length", "do_sample", "early_stopping", "num_beams",
    "num_beam_groups", "diversity_penalty", "temperature", "top_k", "top_p", "typical_p", "repetition_penalty",
    "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "bad_words_ids",
    "num_return_sequences", "output_scores", "return_dict_in_generate", "remove_invalid_values",
    "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens", "forced_bos_token_id",
    "forced_eos_token_id", "pad_token_id", "bos_token_id", "eos_token_id", "sep_token_id", "decoder_start_token_id"))
NOT_COMPUTED_PATTERNS = ("*dropout*", "*pdrop*", "*_token_id", "*aux_loss*", "*z_loss*", "router_*_coef")


def _check_transformers_config(ours: dict, directory: str) -> None:
    """Refuse a directory whose config.json (read by transformers, as from_pretrained would) states
    another value than the transformers model's own config for a key both hold that is not in
    NOT_COMPUTED: its weights have the right shapes and would load into a model that computes something
    else (another activation, epsilon, head count, rope, sliding window, ...). load_hf(check_config=False)
    loads such weights on purpose (a longer context's rope scaling)."""
    if not os.path.exists(os.path.join(directory, "config.json")):
        return
    import transformers

    try:
        theirs = transformers.AutoConfig.from_pretrained(directory).to_dict()
    except (OSError, ValueError, KeyError) as error:
        raise FxShardError(f"{directory}/config.json does not read as a transformers config ({error}); fix or "
                           f"remove it") from None
    differences = _transformers_differences(_derived(theirs), _derived(ours))
    if differences:
        raise FxShardError(f"{directory} computes another function than this {ours.get('model_type')} model: "
                           f"{'; '.join(differences[:6])}. Its weights would load and compute something else; build "
                           f"the model from that directory's config (AutoConfig.from_pretrained), or pass "
                           f"load_hf(..., check_config=False) where the change is meant")


def _transformers_differences(theirs: dict, ours: dict, prefix: str = "") -> list[str]:
    """Each key both configs hold, nested configs' keys as `outer.inner`, whose values differ, said as
    "key theirs (this model: ours)"; NOT_COMPUTED keys left out."""
    found = []
    for key in theirs.keys() & ours.keys():
        if key in NOT_COMPUTED or any(fnmatch.fnmatchcase(key, p) for p in NOT_COMPUTED_PATTERNS):
            continue
        mine, other = ours[key], theirs[key]
        if isinstance(mine, dict) and isinstance(other, dict) and "model_type" in mine:  # a sub-model's config
            found += _transformers_differences(other, mine, f"{prefix}{key}.")
        elif not _same(other, mine):
            found.append(f"{prefix}{key} {other!r} (this model: {mine!r})")
    return sorted(found)


def _derived(config: dict) -> dict:
    """`config` with head_dim as the model uses it where it is left unset (hidden_size / heads)."""
    heads, hidden = config.get("num_attention_heads"), config.get("hidden_size")
    if config.get("head_dim") is None and isinstance(heads, int) and heads > 0 and isinstance(hidden, int):
        return {**config, "head_dim": hidden // heads}
    return config


def _same(a, b) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(a, (int, float)) and isinstance(b, (int, float)) and math.isclose(a, b, rel_tol=1e-6)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def _refuse_unplaced(step, directory: str, extra: set[str], check_config: bool = True) -> None:
    """Refuse a directory holding tensors the model has no place for (a bias, an untied head): loading
    the rest would compute without them, silently. Not weights of its own: a non-persistent buffer a
    save kept (an older transformers' `rotary_emb.inv_freq`, GPT-2's `attn.masked_bias`), another name
    of a tied weight, what the transformers class lists in _keys_to_ignore_on_load_unexpected
    (from_pretrained skips those too).
    With check_config=False (a model cut down on purpose: fewer layers) a warning instead."""
    extra = sorted(name for name in extra if name not in step.transient_buffers  # old saves' buffers:
                   and not name.endswith((".inv_freq", ".masked_bias"))  # RoPE tables, GPT-2's attention-mask fill
                   and name not in step.aliases and not any(re.search(p, name) for p in step.ignored_patterns))
    if not extra:
        return
    said = (f"{directory} holds {len(extra)} tensors this {step.model_class} has no place for (e.g. "
            f"{', '.join(extra[:4])}): the model they come from computes more than this one (biases, an untied "
            f"head, more layers, ...)")
    if check_config:
        raise FxShardError(f"{said}; build the model with the checkpoint's config, or pass load_hf(..., "
                           f"check_config=False) where the model is cut down on purpose")
    warnings.warn(f"fxshard: {said}; they are left out (check_config=False)", stacklevel=4)


def _transformers_layout(model_class: str, model_type: str, files: SafetensorsDirectory) -> dict[str, Source] | None:
    """The directory's tensors under the names a transformers model of `model_type` holds them by,
    through transformers' own conversion mapping (what from_pretrained applies): renamings, and
    experts stored one by one stacked into one tensor (MergeModulelist(dim=0)), several such
    stacks concatenated (Concatenate(dim)), e.g. Mixtral's and Qwen3-MoE's per-expert gate/up/down
    into `experts.gate_up_proj` / `experts.down_proj`. Lazy: each rank reads only its experts'
    rows. None without a mapping; an operation other than these is refused."""
    try:  # transformers 5's declarative conversions
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
        from transformers.core_model_loading import Concatenate, MergeModulelist, WeightConverter, WeightRenaming
    except ImportError:
        return None

    # as from_pretrained gathers them: the class's own mapping (GPTNeoXForCausalLM's embed_out -> lm_head),
    # its model_type's (for the base model inside), and the legacy renamings every model gets
    transforms = [*(get_checkpoint_conversion_mapping(model_class) or []),
                  *(get_checkpoint_conversion_mapping(model_type) or []),
                  *(get_checkpoint_conversion_mapping("legacy") or [])]
    if not transforms:
        return None
    renamed = {}
    for name in files.shapes:
        key = name
        for rename in (t for t in transforms if type(t) is WeightRenaming):
            for pattern, target in zip(rename.source_patterns, rename.target_patterns):
                key = re.sub(pattern, target, key)
        renamed[key] = files.source(name)
    for convert in transforms:
        if type(convert) is WeightRenaming:
            continue
        operations = list(getattr(convert, "operations", []))
        kinds = [type(op) for op in operations]
        if type(convert) is not WeightConverter or kinds not in ([MergeModulelist], [MergeModulelist, Concatenate]) \
                or operations[0].dim != 0 or len(convert.target_patterns) != 1:
            raise FxShardError(f"transformers converts {model_type} checkpoints with {type(convert).__name__} "
                               f"{convert.source_patterns} -> {convert.target_patterns} "
                               f"({', '.join(k.__name__ for k in kinds)}), which fxshard.load_hf does not map; load "
                               f"the directory with from_pretrained and pass that model to shard")
        patterns = [re.compile(re.escape(p).replace(r"\*", r"(\d+)") + "$") for p in convert.source_patterns]
        groups: dict[str, dict[int, dict[int, str]]] = {}  # prefix -> pattern -> expert -> key
        for key in list(renamed):
            for which, pattern in enumerate(patterns):
                if match := pattern.search(key):
                    groups.setdefault(key[:match.start()], {}).setdefault(which, {})[int(match.group(1))] = key
                    break
        for prefix, by_pattern in groups.items():
            stacks, count = [], 1 + max(e for experts in by_pattern.values() for e in experts)
            for which, pattern in enumerate(convert.source_patterns):
                experts = by_pattern.get(which, {})
                if sorted(experts) != list(range(count)):
                    lacking = sorted(set(range(count)) - set(experts))
                    raise FxShardError(f"{files.directory}: {prefix}{pattern} lacks experts {lacking[:8]} (of "
                                       f"{count}): the checkpoint is incomplete; download or copy it again")
                parts = [renamed.pop(experts[e]) for e in range(count)]
                if len({tuple(part.shape) for part in parts}) > 1:
                    raise FxShardError(f"{files.directory}: the experts of {prefix}{pattern} have different shapes "
                                       f"({sorted({tuple(part.shape) for part in parts})}): the checkpoint is corrupt")
                stacks.append(Stack(parts))
            renamed[prefix + convert.target_patterns[0]] = (
                Cat(stacks, operations[1].dim) if len(stacks) > 1 else stacks[0])
    return renamed


def _config_differences(theirs: dict, ours: dict, cfg) -> list[str]:
    """Where a Hugging Face config.json describes another function than `hf_layout`'s config for our
    model: what it states (transformers' defaults stand for the rest), the head counts with
    transformers' defaults where it leaves them out (`_derived`)."""
    rope = theirs.get("rope_parameters") or theirs.get("rope_scaling") or {}
    rope = rope if isinstance(rope, dict) else {}
    heads = theirs.get("num_attention_heads")
    # the head counts change no tensor's shape; where config.json leaves the key/value heads out,
    # transformers' default: one per head (Llama) or 8 (Mixtral)
    kv_default = 8 if theirs.get("model_type") == "mixtral" else heads
    stated = {"hidden_act": theirs.get("hidden_act"), "attention_bias": theirs.get("attention_bias"),
              "mlp_bias": theirs.get("mlp_bias"), "tie_word_embeddings": theirs.get("tie_word_embeddings"),
              "num_attention_heads": heads, "num_key_value_heads": theirs.get("num_key_value_heads") or kv_default,
              "head_dim": _derived(theirs).get("head_dim"), "rope type": rope.get("rope_type", rope.get("type")),
              "num_experts_per_tok": theirs.get("num_experts_per_tok") if "num_local_experts" in ours else None,
              "sliding_window": theirs.get("sliding_window"), "rms_norm_eps": theirs.get("rms_norm_eps"),
              "rope_theta": theirs.get("rope_theta", rope.get("rope_theta"))}
    expected = {**ours, "mlp_bias": False, "head_dim": cfg.d_model // cfg.n_head, "rope type": "default",
                "sliding_window": None}
    return [f"{key} {value!r} (this model: {expected[key]!r})" for key, value in stated.items()
            if value is not None and not _same(value, expected[key])]


def _expert_sources_as_stored(step, sources: dict[str, Source]) -> dict[str, Source]:
    """Expert layers the model stores in another layout than grouped plain rows: read whole, converted."""
    for prefix, (layout, experts) in step.expert_layouts.items():
        if layout == PLAIN:
            continue
        grouped = {"weight": sources.pop(prefix + "weight")}
        whole = {rel: Held(source.read((0,) * len(source.shape), source.shape)) for rel, source in grouped.items()}
        converted = convert_expert_tensors({rel: h.tensor for rel, h in whole.items()}, PLAIN, layout, experts, prefix)
        sources.update({prefix + rel: Held(value) for rel, value in converted.items()})
    return sources

