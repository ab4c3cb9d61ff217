"""PyTorch reference of diffzoo's three attention variants and decoder, written from the equations
in the paper (DIFF V1, eq. 1-3), the official DIFF V2 code and `models/src`'s doc comments.

It writes the golden fixtures the Rust tests load (`models/tests/fixtures/`):

    <case>.weights.safetensors   model weights, PyTorch layout and names (Linear: [out, in])
    <case>.io.safetensors        tokens, targets, logits, loss, one block's attention input and
                                 output, and gradients of the λ parameters (and one projection)

Regenerate with (any recent torch, CPU is enough):

    python models/tests/reference/reference.py models/tests/fixtures
"""

import math
import sys
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

NORM_EPS = 1e-5


class RMSNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + NORM_EPS)).type_as(x) * self.weight


def rope(x, theta):
    """Rotates adjacent pairs (x[2i], x[2i+1]) of x: [B, H, S, d] by position·θ^(-2i/d)."""
    s, d = x.shape[-2], x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=x.device) / d))
    angles = torch.arange(s, dtype=torch.float32, device=x.device)[:, None] * inv_freq[None, :]
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)  # tables on x's device, in its dtype
    x0, x1 = x[..., 0::2], x[..., 1::2]
    out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    return out.flatten(-2)


def heads(x, n):
    b, s, w = x.shape
    return x.view(b, s, n, w // n).transpose(1, 2)


def merge(x):
    b, h, s, d = x.shape
    return x.transpose(1, 2).reshape(b, s, h * d)


def causal_softmax(q, k):
    s, d = q.shape[-2], q.shape[-1]
    logits = q @ k.transpose(-1, -2) / math.sqrt(d)
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), 1)
    return torch.softmax(logits.masked_fill(mask, float("-inf")), dim=-1)


class TransformerAttention(nn.Module):
    def __init__(self, d_model, h, h_kv, theta, head_dim=None, qkv_bias=False):
        super().__init__()
        d = head_dim or d_model // h
        self.h, self.h_kv, self.theta = h, h_kv, theta
        self.q_proj = nn.Linear(d_model, h * d, bias=qkv_bias)
        self.k_proj = nn.Linear(d_model, h_kv * d, bias=qkv_bias)
        self.v_proj = nn.Linear(d_model, h_kv * d, bias=qkv_bias)
        self.o_proj = nn.Linear(h * d, d_model, bias=False)

    def forward(self, x):
        q = rope(heads(self.q_proj(x), self.h), self.theta)
        k = rope(heads(self.k_proj(x), self.h_kv), self.theta)
        v = heads(self.v_proj(x), self.h_kv)
        out = []
        for i in range(self.h):  # head i reads kv head i // n_rep, written out head by head
            g = i // (self.h // self.h_kv)
            out.append(causal_softmax(q[:, i], k[:, g]) @ v[:, g])
        return self.o_proj(merge(torch.stack(out, 1)))


class DiffAttention(nn.Module):
    """DIFF V1: H' = H/2 heads, each with two query half-heads (2h, 2h+1), values of width 2d."""

    def __init__(self, d_model, h, h_kv, theta, depth, head_dim=None, qkv_bias=False):
        super().__init__()
        d = head_dim or d_model // h
        self.h, self.h_kv, self.d, self.theta = h // 2, h_kv // 2, d, theta
        self.lambda_init = 0.8 - 0.6 * math.exp(-0.3 * depth)
        self.q_proj = nn.Linear(d_model, 2 * self.h * d, bias=qkv_bias)
        self.k_proj = nn.Linear(d_model, 2 * self.h_kv * d, bias=qkv_bias)
        self.v_proj = nn.Linear(d_model, self.h_kv * 2 * d, bias=qkv_bias)
        self.o_proj = nn.Linear(self.h * 2 * d, d_model, bias=False)
        for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
            setattr(self, name, nn.Parameter(torch.zeros(d).normal_(0, 0.1)))
        self.subln = RMSNorm(2 * d)

    def lam(self):
        return (torch.exp(torch.sum(self.lambda_q1 * self.lambda_k1).float())
                - torch.exp(torch.sum(self.lambda_q2 * self.lambda_k2).float()) + self.lambda_init)

    def forward(self, x):
        q = rope(heads(self.q_proj(x), 2 * self.h), self.theta)
        k = rope(heads(self.k_proj(x), 2 * self.h_kv), self.theta)
        v = heads(self.v_proj(x), self.h_kv)
        lam = self.lam()
        out = []
        for h in range(self.h):
            g = h // (self.h // self.h_kv)
            a1 = causal_softmax(q[:, 2 * h], k[:, 2 * g])
            a2 = causal_softmax(q[:, 2 * h + 1], k[:, 2 * g + 1])
            out.append((a1 - lam * a2) @ v[:, g])
        o = self.subln(torch.stack(out, 1)) * (1 - self.lambda_init)
        return self.o_proj(merge(o))


class DiffV2Attention(nn.Module):
    """DIFF V2: 2H query heads, one attention, out_h = o_2h - sigmoid(x W_λ)_h o_2h+1."""

    def __init__(self, d_model, h, h_kv, theta, head_dim=None, qkv_bias=False):
        super().__init__()
        d = head_dim or d_model // h
        self.h, self.h_kv, self.theta = h, h_kv, theta
        self.q_proj = nn.Linear(d_model, 2 * h * d, bias=qkv_bias)
        self.k_proj = nn.Linear(d_model, h_kv * d, bias=qkv_bias)
        self.v_proj = nn.Linear(d_model, h_kv * d, bias=qkv_bias)
        self.o_proj = nn.Linear(h * d, d_model, bias=False)
        self.lambda_proj = nn.Linear(d_model, h, bias=False)

    def forward(self, x):
        q = rope(heads(self.q_proj(x), 2 * self.h), self.theta)
        k = rope(heads(self.k_proj(x), self.h_kv), self.theta)
        v = heads(self.v_proj(x), self.h_kv)
        lam = torch.sigmoid(self.lambda_proj(x).float())  # [B, S, H]
        n_rep = 2 * self.h // self.h_kv
        o = [causal_softmax(q[:, i], k[:, i // n_rep]) @ v[:, i // n_rep] for i in range(2 * self.h)]
        out = [o[2 * h] - lam[:, :, h, None] * o[2 * h + 1] for h in range(self.h)]
        return self.o_proj(merge(torch.stack(out, 1)))


class SwiGlu(nn.Module):
    def __init__(self, d_model, hidden):
        super().__init__()
        self.w_g = nn.Linear(d_model, hidden, bias=False)
        self.w1 = nn.Linear(d_model, hidden, bias=False)
        self.w2 = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w_g(x)) * self.w1(x))


class Block(nn.Module):
    def __init__(self, attention, d_model, h, h_kv, theta, depth, ffn=None, head_dim=None, qkv_bias=False):
        super().__init__()
        self.attn_norm = RMSNorm(d_model)
        shape = {"head_dim": head_dim, "qkv_bias": qkv_bias}
        if attention == "transformer":
            self.attn = TransformerAttention(d_model, h, h_kv, theta, **shape)
        elif attention == "diff":
            self.attn = DiffAttention(d_model, h, h_kv, theta, depth, **shape)
        else:
            self.attn = DiffV2Attention(d_model, h, h_kv, theta, **shape)
        self.ffn_norm = RMSNorm(d_model)
        self.ffn = SwiGlu(d_model, ffn or 8 * d_model // 3)

    def forward(self, x, record=None):
        a_in = self.attn_norm(x)
        a_out = self.attn(a_in)
        if record is not None:
            record.append((a_in, a_out))
        h = x + a_out
        return h + self.ffn(self.ffn_norm(h))


class Model(nn.Module):
    """The decoder; `ffn`, `head_dim`, `qkv_bias` and `tie` (the head is the embedding) as the
    model configuration's keys of those names (defaults: 8·d_model/3, d_model / h, none, untied)."""

    def __init__(self, attention, d_model, layers, h, h_kv, vocab, theta, ffn=None, head_dim=None,
                 qkv_bias=False, tie=False):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.blocks = nn.ModuleList(Block(attention, d_model, h, h_kv, theta, i, ffn, head_dim, qkv_bias)
                                    for i in range(layers))
        self.norm = RMSNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab, bias=False)
        if tie:
            self.lm_head.weight = self.embed.weight

    def forward(self, tokens, record=None):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, record)
        return self.lm_head(self.norm(x))


# name: (attention, d_model, heads, kv_heads); all with 2 layers, vocab 48, batch 2, seq 12.
CASES = {
    "transformer_mha": ("transformer", 32, 4, 4),
    "transformer_gqa": ("transformer", 48, 8, 2),
    "diff_mha": ("diff", 32, 4, 4),
    "diff_gqa": ("diff", 48, 8, 4),
    "diff_v2_mha": ("diff-v2", 32, 4, 4),
    "diff_v2_gqa": ("diff-v2", 48, 8, 2),
}
LAYERS, VOCAB, BATCH, SEQ, THETA = 2, 48, 2, 12, 10000.0


def write_case(out: Path, name, attention, d_model, h, h_kv, seed):
    from safetensors.torch import save_file  # only the fixture writer needs it

    torch.manual_seed(seed)
    model = Model(attention, d_model, LAYERS, h, h_kv, VOCAB, THETA)
    with torch.no_grad():  # norms away from 1 so that loading them is tested, λ vectors larger
        for n, p in model.named_parameters():
            if n.endswith("norm.weight") or "subln" in n:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            if "lambda_" in n and "proj" not in n:
                p.copy_(0.4 * torch.randn_like(p))
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ))
    targets = torch.randint(0, VOCAB, (BATCH, SEQ))
    record = []
    logits = model(tokens, record)
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
    loss.backward()
    weights = {n: p.detach().contiguous() for n, p in model.named_parameters()}
    io = {
        "tokens": tokens,
        "targets": targets,
        "logits": logits.detach(),
        "loss": loss.detach().reshape(1),
        "attn_in": record[1][0].detach(),
        "attn_out": record[1][1].detach(),
    }
    for n, p in model.named_parameters():
        if "lambda" in n or n == "blocks.0.attn.q_proj.weight":
            io["grad." + n] = p.grad.detach().contiguous()
    save_file(weights, str(out / f"{name}.weights.safetensors"))
    save_file(io, str(out / f"{name}.io.safetensors"))
    print(f"{name}: loss {loss.item():.6f}")


def main():
    out = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent.parent / "fixtures")
    out.mkdir(parents=True, exist_ok=True)
    torch.set_default_dtype(torch.float32)
    for seed, (name, case) in enumerate(CASES.items()):
        write_case(out, name, *case, seed=seed)


if __name__ == "__main__":
    main()
