"""Models people already have, tiny: transformers' Llama, GPT-2 (tied), BERT, Mixtral and Qwen3-MoE from
random configs, and torchtitan's llama3 and deepseek_v3 as torchtitan 0.3.0 writes them (its model code
imports triton and its training stack, which are not test dependencies; session 53's review imported
the real package on CPU with them added and found the same results: these are written in its style, module names, computation and initialization protocol included: `init_states`,
`param_init`, `_init_self_buffers`). Each comes with its loss and batches with attention
masks (padded rows, ignored labels). Shared by the model matrix (test_parity_models_gloo.py)."""

from __future__ import annotations

from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, SEQ = 64, 8
IGNORE = -100


# ---- torchtitan style (torchtitan/models/common, llama3, deepseek_v3) ------------------------------

class Module(nn.Module):
    """torchtitan's Module (protocols/module.py) as it initializes: `init_states` initializes the
    children (looking inside plain nn.Modules), then the module's own parameters (`_param_init`, an
    init function per parameter name, else `reset_parameters()`), then its own buffers."""

    _param_init = None

    def init_states(self, *, buffer_device=None):
        queue = list(self.children())
        while queue:
            child = queue.pop(0)
            if isinstance(child, Module):
                child.init_states(buffer_device=buffer_device)
            else:
                queue.extend(child.children())
        self._init_self_parameters()
        self._init_self_buffers(buffer_device=buffer_device)

    def _init_self_parameters(self):
        if self._param_init is not None:
            for name, param in self.named_parameters(recurse=False):
                self._param_init[name](param)
        elif callable(getattr(self, "reset_parameters", None)):
            self.reset_parameters()
        elif any(True for _ in self.parameters(recurse=False)):
            raise ValueError(f"{type(self).__name__} has parameters but neither param_init nor reset_parameters")

    def _init_self_buffers(self, *, buffer_device=None):
        pass


def skip_param_init(param):
    """torchtitan's initializer of a tied embedding: the output head initializes the tensor."""


def trunc_normal(std):
    return {"weight": partial(nn.init.trunc_normal_, std=std)}


class Linear(nn.Linear, Module):
    def __init__(self, dim, out, std=0.02):
        super().__init__(dim, out, bias=False)
        self._param_init = trunc_normal(std)


class RMSNorm(nn.RMSNorm, Module):
    _param_init = {"weight": nn.init.ones_}


class Embedding(nn.Embedding, Module):
    _param_init = {"weight": partial(nn.init.normal_, std=1.0)}


class ComplexRoPE(Module):
    """torchtitan's ComplexRoPE: a non-persistent buffer of complex cis values, applied by viewing
    query and key pairs as complex numbers; recomputed by `_init_self_buffers`."""

    def __init__(self, dim, max_seq_len=SEQ, theta=10000.0):
        super().__init__()
        self.dim, self.max_seq_len, self.theta = dim, max_seq_len, theta
        self.register_buffer("cache", self._precompute_cache(), persistent=False)

    def _precompute_cache(self):
        freqs = 1.0 / (self.theta ** (torch.arange(0, self.dim, 2)[: self.dim // 2].float() / self.dim))
        angles = torch.outer(torch.arange(self.max_seq_len).float(), freqs)
        return torch.polar(torch.ones_like(angles), angles)

    def _init_self_buffers(self, *, buffer_device=None):
        with torch.device(buffer_device or self.cache.device):
            self.cache = self._precompute_cache()

    def forward(self, query, key):
        cache = self.cache[: query.shape[1]].view(1, query.shape[1], 1, -1)

        def rotate(x):
            pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
            return torch.view_as_real(pairs * cache).flatten(3).type_as(x)

        return rotate(query), rotate(key)


class FeedForward(Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.w1, self.w2, self.w3 = Linear(dim, hidden), Linear(hidden, dim), Linear(dim, hidden)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class GQAttention(Module):
    """llama3's attention: wq/wk/wv/wo, grouped key-value heads repeated, causal SDPA."""

    def __init__(self, dim, n_heads, n_kv_heads):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, dim // n_heads
        self.wq = Linear(dim, n_heads * self.head_dim)
        self.wk = Linear(dim, n_kv_heads * self.head_dim)
        self.wv = Linear(dim, n_kv_heads * self.head_dim)
        self.wo = Linear(n_heads * self.head_dim, dim)
        self.rope = ComplexRoPE(self.head_dim)

    def forward(self, x):
        bs, seqlen, _ = x.shape
        q = self.wq(x).view(bs, seqlen, self.n_heads, self.head_dim)
        k = self.wk(x).view(bs, seqlen, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(bs, seqlen, self.n_kv_heads, self.head_dim)
        q, k = self.rope(q, k)
        repeats = self.n_heads // self.n_kv_heads
        k, v = (t.repeat_interleave(repeats, dim=2) for t in (k, v))
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(bs, seqlen, -1))


class MLAttention(Module):
    """deepseek_v3's multi-head latent attention (q_lora_rank 0): a low-rank key-value projection with
    its own RMSNorm, a rotary part shared by every head, causal SDPA with the softmax scale given."""

    def __init__(self, dim, n_heads, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8):
        super().__init__()
        self.n_heads, self.kv_lora_rank = n_heads, kv_lora_rank
        self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        self.wq = Linear(dim, n_heads * self.qk_head_dim)
        self.wkv_a = Linear(dim, kv_lora_rank + qk_rope_head_dim)
        self.kv_norm = RMSNorm(kv_lora_rank, eps=1e-6)
        self.wkv_b = Linear(kv_lora_rank, n_heads * (qk_nope_head_dim + v_head_dim))
        self.wo = Linear(n_heads * v_head_dim, dim)
        self.softmax_scale = self.qk_head_dim ** -0.5
        self.rope = ComplexRoPE(qk_rope_head_dim)

    def forward(self, x):
        bsz, seqlen, _ = x.shape
        q = self.wq(x).view(bsz, seqlen, -1, self.qk_head_dim)
        q_nope, q_pe = torch.split(q, [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        kv, k_pe = torch.split(self.wkv_a(x), [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        q_pe, k_pe = self.rope(q_pe, k_pe.unsqueeze(2))
        q = torch.cat([q_nope, q_pe], dim=-1)
        kv = self.wkv_b(self.kv_norm(kv)).view(bsz, seqlen, -1, self.qk_nope_head_dim + self.v_head_dim)
        k_nope, v = torch.split(kv, [self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(-1, -1, k_nope.size(2), -1)], dim=-1)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                             scale=self.softmax_scale)
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))


class TokenChoiceTopKRouter(Module):
    """Sigmoid scores in fp32; the load-balancing bias moves the choice, not the gate values."""

    def __init__(self, dim, num_experts, top_k, route_scale=1.0):
        super().__init__()
        self.gate = Linear(dim, num_experts)
        self.top_k, self.route_scale = top_k, route_scale

    def forward(self, x, expert_bias):
        scores = torch.sigmoid(self.gate(x).float())
        _, ids = torch.topk(scores + expert_bias, k=self.top_k, dim=-1, sorted=False)
        top_scores = scores.gather(dim=-1, index=ids)
        top_scores = top_scores / (top_scores.sum(dim=-1, keepdim=True) + 1e-20)  # route_norm
        return top_scores * self.route_scale, ids, scores


class GroupedExperts(Module):
    """The experts in fp32 (torchtitan casts them to bf16, whose grouped GEMM CPUs lack)."""

    def __init__(self, dim, hidden, num_experts):
        super().__init__()
        self.w1_EFD = nn.Parameter(torch.randn(num_experts, hidden, dim) * dim ** -0.5)
        self.w2_EDF = nn.Parameter(torch.randn(num_experts, dim, hidden) * hidden ** -0.5)
        self.w3_EFD = nn.Parameter(torch.randn(num_experts, hidden, dim) * dim ** -0.5)
        self._param_init = {name: partial(nn.init.trunc_normal_, std=0.02) for name in ("w1_EFD", "w2_EDF", "w3_EFD")}

    def forward(self, x, num_tokens_per_expert):
        offsets = torch.cumsum(num_tokens_per_expert, dim=0, dtype=torch.int32)
        h = F.silu(torch._grouped_mm(x, self.w1_EFD.transpose(-2, -1), offs=offsets))
        h = h * torch._grouped_mm(x, self.w3_EFD.transpose(-2, -1), offs=offsets)
        return torch._grouped_mm(h, self.w2_EDF.transpose(-2, -1), offs=offsets)


class LocalTokenDispatcher(Module):
    """Rows in expert order: a stable argsort of the flattened expert ids, each row the token of its
    sorted index // top_k; the combine scales the experts' outputs by the scores in fp32 and
    scatter_adds them back to the tokens."""

    def __init__(self, top_k):
        super().__init__()
        self.top_k = top_k

    def dispatch(self, x_TD, top_scores_TK, ids_TK):
        order = torch.argsort(ids_TK.view(-1), stable=True)
        sorted_scores = top_scores_TK.view(-1)[order]
        token_of_row = order // self.top_k
        return x_TD[token_of_row], (token_of_row, sorted_scores)

    def combine(self, rows, metadata, x_TD):
        token_of_row, sorted_scores = metadata
        rows = (rows.to(torch.float32) * sorted_scores.reshape(-1, 1)).to(rows.dtype)
        return torch.zeros_like(x_TD).scatter_add(0, token_of_row.reshape(-1, 1).expand(-1, x_TD.shape[-1]), rows)


class RoutedExperts(Module):
    def __init__(self, dim, hidden, num_experts, top_k):
        super().__init__()
        self.inner_experts = GroupedExperts(dim, hidden, num_experts)
        self.token_dispatcher = LocalTokenDispatcher(top_k)

    def forward(self, x_BLD, top_scores, ids, counts):
        x_TD = x_BLD.reshape(-1, x_BLD.shape[-1])
        rows, metadata = self.token_dispatcher.dispatch(x_TD, top_scores.reshape(-1, ids.shape[-1]),
                                                        ids.reshape(-1, ids.shape[-1]))
        out_TD = self.token_dispatcher.combine(self.inner_experts(rows, counts), metadata, x_TD)
        return out_TD.view_as(x_BLD)


class MoE(Module):
    """torchtitan's MoE: the router, counts from a one-hot routing map (also accumulated into a buffer
    for the load-balancing bias that its optimizer hook updates), the routed experts, the shared ones."""

    def __init__(self, dim, hidden, num_experts=4, top_k=2, load_balance_coeff=None):
        super().__init__()
        self.load_balance_coeff = load_balance_coeff  # torchtitan's optimizer hook balances where it is set
        self.router = TokenChoiceTopKRouter(dim, num_experts, top_k)
        self.routed_experts = RoutedExperts(dim, hidden, num_experts, top_k)
        self.shared_experts = FeedForward(dim, hidden)
        self.register_buffer("expert_bias_E", torch.zeros(num_experts), persistent=True)
        self.register_buffer("tokens_per_expert_E", torch.zeros(num_experts), persistent=False)

    def _init_self_buffers(self, *, buffer_device=None):
        with torch.device(buffer_device or self.expert_bias_E.device):
            self.expert_bias_E, self.tokens_per_expert_E = torch.zeros_like(self.expert_bias_E), \
                torch.zeros_like(self.tokens_per_expert_E)

    def forward(self, x_BLD):
        top_scores, ids, scores = self.router(x_BLD, self.expert_bias_E)
        routing_map = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, ids, True)
        counts = routing_map.sum(dim=(0, 1))
        if self.training:
            with torch.no_grad():
                self.tokens_per_expert_E.add_(counts)
        return self.routed_experts(x_BLD, top_scores, ids, counts) + self.shared_experts(x_BLD)


class TransformerBlock(Module):
    def __init__(self, attention, ffn, dim, ffn_name="feed_forward"):
        super().__init__()
        self.attention, self.ffn_name = attention, ffn_name
        self.attention_norm, self.ffn_norm = RMSNorm(dim, eps=1e-5), RMSNorm(dim, eps=1e-5)
        setattr(self, ffn_name, ffn)

    def forward(self, x):
        h = x + self.attention(self.attention_norm(x))
        return h + getattr(self, self.ffn_name)(self.ffn_norm(h))


class Decoder(Module):
    """torchtitan's Decoder: blocks in a ModuleDict keyed "0", "1", ..., tokens in, logits out; with
    `tie`, the embedding is the output head's weight, which the head initializes."""

    def __init__(self, blocks, dim=32, vocab_size=VOCAB, tie=False):
        super().__init__()
        self.tok_embeddings = Embedding(vocab_size, dim)
        self.layers = nn.ModuleDict({str(i): block for i, block in enumerate(blocks)})
        self.norm = RMSNorm(dim, eps=1e-5)
        self.lm_head = Linear(dim, vocab_size, std=dim ** -0.5)
        if tie:
            self.tok_embeddings.weight = self.lm_head.weight
            self.tok_embeddings._param_init = {"weight": skip_param_init}

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h)
        return self.lm_head(self.norm(h))


def titan_llama3(dim=32, layers=2, tie=False):
    return Decoder([TransformerBlock(GQAttention(dim, 4, 2), FeedForward(dim, 64), dim) for _ in range(layers)], dim,
                   tie=tie)


def titan_deepseek_v3(dim=32, layers=3, load_balance_coeff=None):
    """The first layer dense, the others MoE (4 experts, top-2, a shared expert)."""
    blocks = [TransformerBlock(MLAttention(dim, 4), FeedForward(dim, 64), dim)]
    blocks += [TransformerBlock(MLAttention(dim, 4), MoE(dim, 16, load_balance_coeff=load_balance_coeff), dim,
                                ffn_name="moe") for _ in range(layers - 1)]
    return Decoder(blocks, dim)


def titan_loss(model, batch):
    """torchtitan's cross-entropy over the flattened logits; padding is ignored by its labels."""
    logits = model(batch["input_ids"])
    return F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten(), ignore_index=IGNORE)


# ---- transformers ------------------------------------------------------------------------------------

def transformers_model(name):
    import transformers

    no_dropout = dict(attention_dropout=0.0)
    configs = {
        "llama": ("LlamaConfig", "LlamaForCausalLM",
                  dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, **no_dropout)),
        "gpt2": ("GPT2Config", "GPT2LMHeadModel",  # lm_head tied to wte
                 dict(n_positions=SEQ, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
                      attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)),
        "bert": ("BertConfig", "BertForMaskedLM",  # the decoder tied to the word embeddings
                 dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                      max_position_embeddings=SEQ, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)),
        "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                    dict(hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2,
                         **no_dropout)),
        "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                      dict(hidden_size=32, intermediate_size=32, moe_intermediate_size=16, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4,
                           num_experts_per_tok=2, **no_dropout)),
    }
    config_name, model_name, sizes = configs[name]
    return getattr(transformers, model_name)(getattr(transformers, config_name)(vocab_size=VOCAB, **sizes))


def transformers_loss(model, batch):
    return model(**batch, use_cache=False).loss


def bert_loss(model, batch):
    return model(**batch).loss


# ---- the zoo -----------------------------------------------------------------------------------------

MODELS = {  # name: (build, loss, is_moe)
    "llama": (lambda: transformers_model("llama"), transformers_loss, False),
    "gpt2": (lambda: transformers_model("gpt2"), transformers_loss, False),
    "bert": (lambda: transformers_model("bert"), bert_loss, False),
    "mixtral": (lambda: transformers_model("mixtral"), transformers_loss, True),
    "qwen3_moe": (lambda: transformers_model("qwen3_moe"), transformers_loss, True),
    "titan_llama3": (titan_llama3, titan_loss, False),
    # torchtitan's default coefficient: its load balancing runs in the step (fxshard/balance.py), and in
    # eager_losses as torchtitan's optimizer hook
    "titan_deepseek_v3": (lambda: titan_deepseek_v3(load_balance_coeff=1e-3), titan_loss, True),
}


def build(name, seed=0):
    torch.manual_seed(seed)
    return MODELS[name][0]()


def masked_batches(name, steps, rows=4, seed=0):
    """`steps` batches of `rows` rows: every odd row padded by 3 (masked out and ignored by the labels),
    on the right in the first half of the rows, on the left in the second (a query row that sees no key).
    Causal LMs predict every real token; BERT's masked LM every third."""
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (rows, SEQ), generator=generator)
        mask = torch.ones(rows, SEQ, dtype=torch.long)
        mask[1:rows // 2:2, -3:] = 0
        mask[rows // 2 + 1::2, :3] = 0
        labels = torch.where(mask.bool(), ids, IGNORE)
        if name == "bert":
            labels[:, torch.arange(SEQ) % 3 != 0] = IGNORE
        batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
        if name.startswith("titan_"):  # torchtitan's models take tokens only: padding lives in the labels
            del batch["attention_mask"]
        batches.append(batch)
    return batches


def rows_of(batch, start, stop):
    return {k: v[start:stop] for k, v in batch.items()}


def eager_losses(name, batches, pieces, optimizer):
    """The model trained eagerly with torch.optim: each step's loss is the mean of `loss(piece)` over
    the batch's `pieces` equal row ranges (data-parallel ranks, or microbatches), as fxshard defines a
    step's loss; returns the losses, the final parameters and the final buffers."""
    from fxshard.testing import torch_optimizer

    model = build(name)
    _, loss_fn, _ = MODELS[name]
    torch_opt = torch_optimizer(optimizer, model.parameters())
    losses = []
    for batch in batches:
        rows = len(batch["input_ids"]) // pieces
        torch_opt.zero_grad()
        loss = sum(loss_fn(model, rows_of(batch, i * rows, (i + 1) * rows)) for i in range(pieces)) / pieces
        loss.backward()
        torchtitan_balancing_hook(model)
        torch_opt.step()
        losses.append(loss.item())
    return losses, dict(model.named_parameters()), dict(model.named_buffers())


def torchtitan_balancing_hook(model):
    """torchtitan's optimizer pre-step hook for its MoE load balancing (components/optimizer/optimizer.py,
    `_update_expert_bias`), on one process (its counts are the whole batch's already)."""
    with torch.no_grad():
        for moe in model.modules():
            if getattr(moe, "load_balance_coeff", None) is not None:
                counts = moe.tokens_per_expert_E.float()
                delta = moe.load_balance_coeff * torch.sign(counts.mean() - counts)
                moe.expert_bias_E.add_(delta - delta.mean())
                moe.tokens_per_expert_E.zero_()


def within(ours: float, eager: float, tolerance: float) -> bool:
    return abs(ours - eager) <= tolerance * abs(eager)

