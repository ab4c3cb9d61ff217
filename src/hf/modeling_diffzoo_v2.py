"""DIFF Transformer V2 for Hugging Face transformers, as diffzoo trains it.

Written by `diffzoo export hf` beside a DIFF V2 checkpoint (transformers has no class for V2);
load it with `AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)`. Self-contained:
torch and transformers only. The equations are diffzoo's `models/src/attention/diff_v2.rs`:

    With H heads (`num_attention_heads`, the baseline's count), H_kv key/value heads and head dim d:
    Q = RoPE(X·W_q) [B, 2H, S, d],  K = RoPE(X·W_k), V = X·W_v [B, H_kv, S, d]
    o_i = softmax(Q_i·K_{i/n}ᵀ/√d + causal mask)·V_{i/n}         n = 2H/H_kv: one attention, 2H heads
    λ_{t,h} = sigmoid(x_t·W_λ),  W_λ: hidden → H, no bias          per token and head, in f32
    out_h = o_{2h} − λ_{t,h}·o_{2h+1}                             no subln, no λ_init
    out = Concat(out_0 … out_{H−1})·W_o

The block around it is Llama's: pre-norm RMSNorm, SwiGLU, no biases (but on q, k and v with
`qkv_bias`), RoPE by `rotate_half` (its frequencies rescaled by `rope_parameters` as Llama's)
(diffzoo permutes q/k rows on export so that this layout computes its adjacent-pair rotation).
There is no KV cache: each call recomputes the whole sequence.
"""

import math

import torch
from torch import nn
from torch.nn import functional as F
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast


class DiffzooV2Config(PretrainedConfig):
    model_type = "diffzoo_v2"

    def __init__(
        self,
        vocab_size=32000,
        hidden_size=512,
        intermediate_size=1365,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=None,
        head_dim=None,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        rope_parameters=None,
        tie_word_embeddings=False,
        hidden_act="silu",
        qkv_bias=False,
        attention_bias=False,
        mlp_bias=False,
        attention_dropout=0.0,
        **kwargs,
    ):
        if hidden_act != "silu" or attention_bias or mlp_bias or attention_dropout:
            raise ValueError("DIFF V2 as diffzoo trains it has SwiGLU, no biases but on q/k/v, no attention dropout")
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads or num_attention_heads
        self.head_dim = head_dim or hidden_size // num_attention_heads
        self.max_position_embeddings = max_position_embeddings
        self.rms_norm_eps = rms_norm_eps
        rope_parameters = dict(rope_parameters or {})
        if rope_parameters.get("rope_type", "default") not in ("default", "linear", "llama3"):
            raise ValueError("RoPE types: default, linear and llama3")
        rope_parameters.setdefault("rope_type", "default")
        rope_parameters.setdefault("rope_theta", rope_theta)
        self.rope_parameters = rope_parameters
        self.rope_theta = rope_parameters["rope_theta"]
        self.hidden_act = hidden_act
        self.qkv_bias = qkv_bias
        self.attention_bias = attention_bias
        self.mlp_bias = mlp_bias
        self.attention_dropout = attention_dropout
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)


class DiffzooV2RMSNorm(nn.Module):
    def __init__(self, size, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def inverse_frequencies(config, device):
    """θ^(−2i/d), rescaled as transformers' `linear` and `llama3` RoPE types rescale them."""
    d, p = config.head_dim, config.rope_parameters
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=device) / d))
    if p["rope_type"] == "linear":
        inv_freq = inv_freq / p["factor"]
    elif p["rope_type"] == "llama3":
        factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
        old = p.get("original_max_position_embeddings", config.max_position_embeddings)
        wavelen = 2 * math.pi / inv_freq
        smooth = (old / wavelen - low) / (high - low)
        blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        inv_freq = torch.where(
            wavelen < old / high, inv_freq, torch.where(wavelen > old / low, inv_freq / factor, blended)
        )
    return inv_freq


def rope_tables(config, seq_len, device, dtype):
    """cos and sin of position·θᵢ, each half of the head repeated: [S, d]."""
    inv_freq = inverse_frequencies(config, device)
    angles = torch.arange(seq_len, dtype=torch.float32, device=device)[:, None] * inv_freq[None, :]
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


class DiffzooV2Attention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        if (2 * self.heads) % self.kv_heads:
            raise ValueError("2·num_attention_heads must be a multiple of num_key_value_heads")
        hidden, d = config.hidden_size, self.head_dim
        bias = config.qkv_bias
        self.q_proj = nn.Linear(hidden, 2 * self.heads * d, bias=bias)
        self.k_proj = nn.Linear(hidden, self.kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(hidden, self.kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(self.heads * d, hidden, bias=False)
        self.lambda_proj = nn.Linear(hidden, self.heads, bias=False)

    def forward(self, x, cos, sin, mask):
        b, s, _ = x.shape
        d = self.head_dim
        q = self.q_proj(x).view(b, s, 2 * self.heads, d).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.kv_heads, d).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.kv_heads, d).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        n_rep = 2 * self.heads // self.kv_heads
        k = k.repeat_interleave(n_rep, dim=1)
        v = v.repeat_interleave(n_rep, dim=1)
        scores = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(d) + mask
        o = torch.matmul(F.softmax(scores.float(), dim=-1).to(q.dtype), v)  # [B, 2H, S, d]
        lam = torch.sigmoid(self.lambda_proj(x).float())  # [B, S, H]
        pairs = o.view(b, self.heads, 2, s, d)
        lam = lam.transpose(1, 2).unsqueeze(-1).to(o.dtype)  # [B, H, S, 1]
        out = pairs[:, :, 0] - lam * pairs[:, :, 1]
        return self.o_proj(out.transpose(1, 2).reshape(b, s, self.heads * d))


class DiffzooV2MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DiffzooV2Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.input_layernorm = DiffzooV2RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DiffzooV2Attention(config)
        self.post_attention_layernorm = DiffzooV2RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = DiffzooV2MLP(config)

    def forward(self, x, cos, sin, mask):
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class DiffzooV2PreTrainedModel(PreTrainedModel):
    config_class = DiffzooV2Config
    base_model_prefix = "model"
    _no_split_modules = ["DiffzooV2Block"]

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        elif isinstance(module, DiffzooV2RMSNorm):
            nn.init.ones_(module.weight)


class DiffzooV2Model(DiffzooV2PreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DiffzooV2Block(config) for _ in range(config.num_hidden_layers))
        self.norm = DiffzooV2RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    def forward(self, input_ids=None, attention_mask=None, inputs_embeds=None):
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("give exactly one of input_ids and inputs_embeds")
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        s = x.shape[1]
        if s > self.config.max_position_embeddings:
            raise ValueError(f"{s} tokens exceed max_position_embeddings = {self.config.max_position_embeddings}")
        cos, sin = rope_tables(self.config, s, x.device, x.dtype)
        floor = torch.finfo(torch.float32).min
        mask = torch.full((s, s), floor, device=x.device).triu(1)[None, None]
        if attention_mask is not None:
            # Padding: key positions whose mask is 0 receive no attention.
            mask = mask + (1.0 - attention_mask[:, None, None, :].float()) * floor
            mask = mask.clamp(min=floor)
        for layer in self.layers:
            x = layer(x, cos, sin, mask)
        return self.norm(x)


class DiffzooV2ForCausalLM(DiffzooV2PreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config):
        super().__init__(config)
        self.model = DiffzooV2Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, value):
        self.lm_head = value

    def prepare_inputs_for_generation(self, input_ids, attention_mask=None, **kwargs):
        # No KV cache: every step reads the whole sequence.
        return {"input_ids": input_ids, "attention_mask": attention_mask}

    def forward(self, input_ids=None, attention_mask=None, inputs_embeds=None, labels=None, **kwargs):
        hidden = self.model(input_ids, attention_mask, inputs_embeds)
        logits = self.lm_head(hidden)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(
                logits[:, :-1].float().reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100
            )
        return CausalLMOutputWithPast(loss=loss, logits=logits)
