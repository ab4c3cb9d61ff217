"""PyTorch eager twin of `diffzoo bench`: the same model, shapes, step and thread count, timed
the same way, printed as one JSON object that `diffzoo bench --torch` reads.

The model is the golden reference (`models/tests/reference/reference.py`: same parameters, same
names, same equations) with its attention written the way a PyTorch user would: batched over
heads, through `F.scaled_dot_product_attention` (`--attention-impl sdpa`, the default; on CPU
a fused flash-attention kernel forward and backward; DIFF V1 attends to its 2d-wide values as two
d-wide halves, since the fused kernels need V as wide as Q and K) or as explicit matmul + softmax maps
(`--attention-impl explicit`, the algorithm Burn's autodiff runs). Before timing, each variant's
vectorised forward pass is checked against the reference's head-by-head one.

A training step is what diffzoo's is: forward, mean cross-entropy, backward, gradients clipped
to global norm 1.0, AdamW (decoupled weight decay 0.1, betas 0.9/0.95); the loss is read back
each step, as the trainer does. Forward throughput is a `torch.no_grad()` forward pass.

On the CPU, subnormal floats are flushed to zero (`torch.set_flush_denormal`): x86 computes on
them in microcode, tens of times slower, and a few steps into training at a 135M-parameter
shape the backward pass's products met them and the step slowed threefold, step after step, to a
third of transformers' own training step on the same shape (measured 2026-12-05, Intel Xeon).
Flushed, the reference trains as fast as transformers there; its loss is unchanged to f32
precision.

The reference's forward pass is itself checked, in the same run: for the baseline (`transformer`),
transformers' own class of that architecture (`LlamaForCausalLM`, or `Qwen2ForCausalLM` with
q/k/v biases) is built on the same shape (its parameter count checked against the reference's),
dtype, threads and attention implementation (`sdpa` or `eager`), and its forward pass timed the
same way, after the reference's figures and before any profiling. Its weights are random: a
forward pass's speed does not depend on their values (subnormals are flushed). `diffzoo bench`
warns when the reference is more than 20% slower than transformers (a bug in the reference, whose
ratios would then flatter ours) or could not be checked. The training step is not checked.

With `--profile`, after the timed steps, `--reps` more run under `torch.profiler` with the
operations labelled by diffzoo's classes (`diffzoo bench --profile`): the linear layers' products
(matmul), the attention core, RMSNorm, RoPE, SwiGLU's gate (activation), the embedding and the loss,
each labelled forward operation's backward counted with its class (the profiler's sequence numbers
pair them), and `other` what the pass took beyond its classes.

Peak memory: on CPU the growth of the process's peak resident set over its size before the model
was built (Linux `VmHWM`, reset through `/proc/self/clear_refs`); on CUDA the allocator's peak
reservation.

    python bench/torch_reference.py --attention transformer,diff --d-model 256 --layers 4 \
        --heads 4 --vocab 4096 --seq 256 --batch 8 --threads 2
"""

import argparse
import json
import math
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch.nn import functional as F
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "models" / "tests" / "reference"))
import reference  # noqa: E402

IMPL = "sdpa"
# Parameters without weight decay: diffzoo's default `optimizer.no_decay`.
NO_DECAY = r"norm|subln|embed|lambda_[qk][12]"


def attend(q, k, v):
    """Causal attention of q [B, H, S, d] over k [B, H_kv, S, d], v [B, H_kv, S, d_v]."""
    if IMPL == "sdpa":
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])
    n_rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(n_rep, 1), v.repeat_interleave(n_rep, 1)
    s = q.shape[-2]
    logits = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool, device=q.device), 1)
    return torch.softmax(logits.masked_fill(mask, float("-inf")), dim=-1) @ v


class TransformerAttention(reference.TransformerAttention):
    def forward(self, x):
        q = reference.rope(reference.heads(self.q_proj(x), self.h), self.theta)
        k = reference.rope(reference.heads(self.k_proj(x), self.h_kv), self.theta)
        v = reference.heads(self.v_proj(x), self.h_kv)
        return self.o_proj(reference.merge(attend(q, k, v)))


class DiffAttention(reference.DiffAttention):
    def forward(self, x):
        b, s, _ = x.shape
        q = reference.rope(reference.heads(self.q_proj(x), 2 * self.h), self.theta)
        k = reference.rope(reference.heads(self.k_proj(x), 2 * self.h_kv), self.theta)
        v = reference.heads(self.v_proj(x), self.h_kv)
        q = q.view(b, self.h, 2, s, self.d)
        k = k.view(b, self.h_kv, 2, s, self.d)
        # SDPA's fused CPU and GPU kernels need V as wide as Q and K: attend to V's two d-wide
        # halves and concatenate, as the official flash-attention code does.
        halves = v.split(self.d, dim=-1)

        def attend_2d(q, k):
            return torch.cat([attend(q, k, half) for half in halves], dim=-1)

        a1v = attend_2d(q[:, :, 0], k[:, :, 0])
        a2v = attend_2d(q[:, :, 1], k[:, :, 1])
        lam = self.lam().to(x.dtype)
        o = self.subln(a1v - lam * a2v) * (1 - self.lambda_init)
        return self.o_proj(reference.merge(o))


class DiffV2Attention(reference.DiffV2Attention):
    def forward(self, x):
        b, s, _ = x.shape
        q = reference.rope(reference.heads(self.q_proj(x), 2 * self.h), self.theta)
        k = reference.rope(reference.heads(self.k_proj(x), self.h_kv), self.theta)
        v = reference.heads(self.v_proj(x), self.h_kv)
        o = attend(q, k, v).view(b, self.h, 2, s, -1)
        lam = torch.sigmoid(self.lambda_proj(x).float()).to(x.dtype)  # [B, S, H]
        out = o[:, :, 0] - lam.transpose(1, 2)[..., None] * o[:, :, 1]
        return self.o_proj(reference.merge(out))


FAST = {"transformer": TransformerAttention, "diff": DiffAttention, "diff-v2": DiffV2Attention}


def vectorised(model):
    """Gives every block's attention its batched forward pass (subclasses: same parameters)."""
    for block in model.blocks:
        block.attn.__class__ = next(c for c in FAST.values() if isinstance(block.attn, c.__bases__[0]))
    return model


CLASSES = ("matmul", "attention", "norm", "rotary", "activation", "embedding", "loss")
LABEL = "diffzoo::"


def labelled(name, fn):
    def run(*args, **kwargs):
        with record_function(LABEL + name):
            return fn(*args, **kwargs)
    return run


def swiglu_labelled(self, x):
    gate, up = self.w_g(x), self.w1(x)
    with record_function(LABEL + "activation"):
        hidden = F.silu(gate) * up
    return self.w2(hidden)


def label_classes():
    """From now on, the model's operations run inside `record_function` labels of their class."""
    global attend
    attend = labelled("attention", attend)
    torch.nn.Linear.forward = labelled("matmul", torch.nn.Linear.forward)
    torch.nn.Embedding.forward = labelled("embedding", torch.nn.Embedding.forward)
    reference.RMSNorm.forward = labelled("norm", reference.RMSNorm.forward)
    reference.rope = labelled("rotary", reference.rope)
    reference.SwiGlu.forward = swiglu_labelled


def classified(events, steps):
    """Seconds per step of the forward and backward passes, by class (see the module doc)."""
    def label(e):
        return e.name[len(LABEL):] if e.name.startswith(LABEL) else None

    passes = {"forward": {}, "backward": {}}
    totals = {"forward": 0.0, "backward": 0.0}
    seq_class = {}

    def walk(e, phase, cls):
        name = label(e)
        if name in totals:
            phase = name
            totals[name] += e.cpu_time_total
        elif name in CLASSES:
            nested = sum(c.cpu_time_total for c in descendants_labelled(e))
            passes[phase][name] = passes[phase].get(name, 0.0) + e.cpu_time_total - nested
            cls = name
        elif phase == "backward" and e.name.startswith("autograd::engine::evaluate_function"):
            owner = seq_class.get(e.sequence_nr)
            if owner is not None:
                passes[phase][owner] = passes[phase].get(owner, 0.0) + e.cpu_time_total
            return
        if phase == "forward" and e.sequence_nr >= 0:
            # An event carries the sequence number its op's autograd node gets, or, where it
            # makes none, the next node's: the last event outside a class decides.
            if cls is None:
                seq_class.pop(e.sequence_nr, None)
            else:
                seq_class[e.sequence_nr] = cls
        for child in e.cpu_children:
            walk(child, phase, cls)

    def descendants_labelled(e):
        for child in e.cpu_children:
            if label(child) in CLASSES:
                yield child
            else:
                yield from descendants_labelled(child)

    for e in events:
        if e.cpu_parent is None:
            walk(e, None, None)
    out = {}
    for phase, classes in passes.items():
        total = totals[phase] / 1e6 / steps
        row = {c: classes.get(c, 0.0) / 1e6 / steps for c in CLASSES}
        row["other"] = max(total - sum(row.values()), 0.0)
        out[phase] = {"total": total, "classes": row}
    return out


def build(args, attention):
    return reference.Model(attention, args.d_model, args.layers, args.heads, args.kv_heads or args.heads,
                           args.vocab, 10000.0, ffn=args.ffn_dim, head_dim=args.head_dim,
                           qkv_bias=args.qkv_bias, tie=args.tie_embeddings)


def check(attention, heads, kv_heads):
    """The batched attention gives the reference's head-by-head logits."""
    torch.manual_seed(0)
    model = reference.Model(attention, 8 * heads, 2, heads, kv_heads, 64, 10000.0)
    tokens = torch.randint(0, 64, (2, 19))
    with torch.no_grad():
        want = model(tokens)
        got = vectorised(model)(tokens)
    worst = (got - want).abs().max().item()
    if worst > 1e-5:
        sys.exit(f"torch_reference.py: the batched {attention} attention differs from the reference by {worst}")


class PeakMemory:
    """Peak memory growth during a measurement (see the module doc)."""

    def __init__(self, device):
        self.device = device
        self.base = self._rss("VmRSS") if device.type == "cpu" else 0

    @staticmethod
    def _rss(field):
        try:
            for line in Path("/proc/self/status").read_text().splitlines():
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
        except OSError:
            return None
        return None

    def reset(self):
        self.was_reset = True
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        try:
            Path("/proc/self/clear_refs").write_text("5")
        except OSError:
            self.was_reset = False

    def peak(self):
        if self.device.type == "cuda":
            return torch.cuda.max_memory_reserved(self.device)
        hwm = self._rss("VmHWM")
        if hwm is None or self.base is None or not self.was_reset:
            return None
        return max(hwm - self.base, 0)


def timed(fn, warmup, reps, sync):
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return times


def spread(n, times):
    """Tokens per second of each repetition: min, median, max."""
    rates = sorted(n / t for t in times)
    return {"min": rates[0], "median": statistics.median(rates), "max": rates[-1]}


def measure(args, attention, device, dtype):
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    memory = PeakMemory(device)
    torch.manual_seed(args.seed)
    model = vectorised(build(args, attention)).to(device=device, dtype=dtype)
    params = sum(p.numel() for p in model.parameters())  # a tied head's weight counted once
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), device=device)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    n = args.batch * args.seq

    def forward():
        with torch.no_grad():
            model(inputs).sum().item()

    no_decay = re.compile(NO_DECAY)
    decay = [p for name, p in model.named_parameters() if not no_decay.search(name)]
    rest = [p for name, p in model.named_parameters() if no_decay.search(name)]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                                  lr=1e-4, betas=(0.9, 0.95), eps=1e-8)

    phases = []  # (forward+backward, clipping, optimizer) seconds of each step, as diffzoo times them

    def step():
        start = time.perf_counter()
        logits = model(inputs).float()
        loss = F.cross_entropy(logits.reshape(-1, args.vocab), targets.reshape(-1))
        loss.backward()
        loss.item()
        sync()
        backward_done = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        sync()
        clipped = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync()
        phases.append((backward_done - start, clipped - backward_done, time.perf_counter() - clipped))

    memory.reset()
    step_s = timed(step, args.warmup, args.reps, sync)
    timed_phases = phases[len(phases) - args.reps:]
    peak = memory.peak()
    forward_s = timed(forward, args.warmup, args.reps, sync)
    # Before the profile's labels, which cost a little per call.
    checked = transformers_forward(args, model, inputs, sync) if attention == "transformer" else None
    step_profile = None
    if args.profile:  # after every timed figure: the labels cost a little per call
        label_classes()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(args.reps):
                with record_function(LABEL + "forward"):
                    logits = model(inputs).float()
                    with record_function(LABEL + "loss"):
                        loss = F.cross_entropy(logits.reshape(-1, args.vocab), targets.reshape(-1))
                with record_function(LABEL + "backward"):
                    loss.backward()
                loss.item()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        step_profile = classified(prof.events(), args.reps)
    del optimizer
    return {
        "attention": attention,
        "params": params,
        "forward_tokens_per_sec": n / statistics.median(forward_s),
        "step_tokens_per_sec": n / statistics.median(step_s),
        "forward_spread": spread(n, forward_s),
        "step_spread": spread(n, step_s),
        "peak_bytes": peak,
        "profile": step_profile,
        "step_phases": {
            name: statistics.median(p[i] for p in timed_phases)
            for i, name in enumerate(["forward_backward", "clipping", "optimizer"])
        },
        "transformers": checked,
    }


def transformers_forward(args, reference, inputs, sync):
    """transformers' own baseline of the `reference` model's shape, its forward pass on `inputs`:
    its speed checks the reference's (see the module doc); or why it could not be timed."""
    try:
        return timed_transformers(args, reference, inputs, sync)
    except Exception as e:  # any failure leaves the reference unchecked, its own figures kept
        return {"unavailable": f"{type(e).__name__}: {e}"}


def timed_transformers(args, reference, inputs, sync):
    import transformers

    attn, embed = reference.blocks[0].attn, reference.embed
    family = "Qwen2" if attn.q_proj.bias is not None else "Llama"
    config = getattr(transformers, f"{family}Config")(
        vocab_size=embed.num_embeddings,
        hidden_size=embed.embedding_dim,
        intermediate_size=reference.blocks[0].ffn.w1.out_features,
        num_hidden_layers=len(reference.blocks),
        num_attention_heads=attn.h,
        num_key_value_heads=attn.h_kv,
        head_dim=attn.q_proj.out_features // attn.h,
        tie_word_embeddings=reference.lm_head.weight is embed.weight,
        max_position_embeddings=max(inputs.shape[1], 2048),
        attn_implementation="sdpa" if IMPL == "sdpa" else "eager",
    )
    torch.manual_seed(args.seed)
    model = getattr(transformers, f"{family}ForCausalLM")(config)
    model = model.to(device=inputs.device, dtype=embed.weight.dtype).eval()
    # A tied head's weight counted once on both sides.
    theirs, ours = (sum(p.numel() for p in m.parameters()) for m in (model, reference))
    if theirs != ours:
        return {"unavailable": f"transformers' {type(model).__name__} of this shape has {theirs} parameters, "
                               f"the reference {ours}: not the same model"}

    def forward():
        with torch.no_grad():
            model(inputs, use_cache=False).logits.sum().item()

    times = timed(forward, args.warmup, args.reps, sync)
    n = inputs.numel()
    return {
        "class": type(model).__name__,
        "version": transformers.__version__,
        "forward_tokens_per_sec": n / statistics.median(times),
        "forward_spread": spread(n, times),
    }


def roofline(reps):
    """FLOP/s of a 2048 × 2048 product in f32 and bf16 (median of `reps`, after one untimed)."""
    n, peaks = 2048, {}
    for name, dtype in (("f32", torch.float32), ("bf16", torch.bfloat16)):
        a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
        times = timed(lambda: (a @ b).sum().item(), 1, reps, lambda: None)
        peaks[f"matmul_{name}"] = 2 * n ** 3 / statistics.median(times)
    return peaks


def main():
    global IMPL
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--attention", default="transformer,diff,diff-v2")
    p.add_argument("--d-model", type=int, required=True)
    p.add_argument("--layers", type=int, required=True)
    p.add_argument("--heads", type=int, required=True)
    p.add_argument("--kv-heads", type=int, default=None)
    p.add_argument("--ffn-dim", type=int, default=None)
    p.add_argument("--head-dim", type=int, default=None)
    p.add_argument("--qkv-bias", action="store_true")
    p.add_argument("--tie-embeddings", action="store_true")
    p.add_argument("--vocab", type=int, required=True)
    p.add_argument("--seq", type=int, required=True)
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="f32", choices=["f32", "bf16", "f16"])
    p.add_argument("--attention-impl", default="sdpa", choices=["sdpa", "explicit"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", action="store_true", help="also profile steps by class (see the module doc)")
    p.add_argument("--roofline", action="store_true", help="print the matmul peaks and exit")
    if "--roofline" in sys.argv:
        q = argparse.ArgumentParser()
        q.add_argument("--roofline", action="store_true")
        q.add_argument("--reps", type=int, default=5)
        q.add_argument("--threads", type=int, default=None)
        known, _ = q.parse_known_args()
        if known.threads:
            torch.set_num_threads(known.threads)
        print(json.dumps(roofline(known.reps)))
        return
    args = p.parse_args()
    IMPL = args.attention_impl
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_flush_denormal(True)
    dtype = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}[args.dtype]
    variants = args.attention.split(",")
    for attention in variants:
        if attention not in FAST:
            sys.exit(f"torch_reference.py: unknown attention `{attention}`: expected transformer, diff, diff-v2")
    if len(variants) == 1:
        check(variants[0], 4, 2)
        results = [measure(args, variants[0], device, dtype)]
    else:  # one process per variant, so that each peak is its own
        results = []
        for attention in variants:
            argv = [f"--{k.replace('_', '-')}" + ("" if v is True else f"={v}")
                    for k, v in vars(args).items() if v is not None and v is not False]
            argv.append(f"--attention={attention}")
            out = subprocess.run([sys.executable, __file__, *argv], check=True, stdout=subprocess.PIPE, text=True)
            results += json.loads(out.stdout)["results"]
    print(json.dumps({
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "device": str(device),
        "dtype": args.dtype,
        "attention_impl": IMPL,
        "results": results,
    }))


if __name__ == "__main__":
    main()
