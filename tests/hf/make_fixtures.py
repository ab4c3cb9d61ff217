"""Writes the Hugging Face fixtures `tests/hf.rs` imports: tiny random checkpoints made and saved by
transformers itself, with the per-token NLL transformers computes on fixed token ids.

    tests/hf/fixtures/<case>/            config.json, weights (and tokenizer.json) as saved
    tests/hf/fixtures/<case>.tokens.json {"input_ids": [[...], ...]}, what `eval ppl --tokens` reads
    tests/hf/fixtures/<case>.nll.json    {"nll": [[...], ...]}, nll[b][t] = −log p(ids[b][t+1] | ids[b][≤t])

Cases: llama_gqa (LlamaForCausalLM, GQA, bf16, sharded, rope θ 5e5, ε 1e-2), diffllama_mha
(DiffLlamaForCausalLM, tied embeddings, with a tokenizer) and diffllama_gqa (3 layers, GQA,
ε 0.05). The large ε make a norm that ignores `rms_norm_eps` visible in the NLL.
Norm weights and λ vectors are drawn away from their initial values, and the other weights are
large, so that a mapping that drops or misplaces anything changes the NLL.

Regenerate with (a venv holding torch and transformers, e.g. the one `bash .ci/setup hf` makes):

    target/torch-venv/bin/python tests/hf/make_fixtures.py tests/hf/fixtures
"""

import json
import shutil
import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import DiffLlamaConfig, DiffLlamaForCausalLM, LlamaConfig, LlamaForCausalLM

VOCAB = 300
SEQ = 20

TEXT = [
    "Differential attention cancels noise the way a differential amplifier does.",
    "The quick brown fox jumps over the lazy dog, 1234567890 times.",
    "Shall I compare thee to a summer's day? Thou art more lovely and more temperate.",
] * 20


def tokenizer():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(TEXT, trainer)
    return tok


def perturb(model, generator):
    """Moves every norm weight and λ vector off its initial value."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=generator))
            elif "lambda_" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=generator))


def nll(model, ids):
    with torch.no_grad():
        logits = model(ids).logits.float()
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none"
    ).reshape(ids.shape[0], -1)


def case(out, name, cls, config, seed, dtype=torch.float32, shard=None, with_tokenizer=False):
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = cls(config).eval()
    perturb(model, generator)
    directory = out / name
    shutil.rmtree(directory, ignore_errors=True)
    kwargs = {"max_shard_size": shard} if shard else {}
    model.to(dtype).save_pretrained(directory, **kwargs)
    if with_tokenizer:
        tokenizer().save(str(directory / "tokenizer.json"))
    # The reference computes in f32 from the weights as saved (bf16 ones upcast exactly).
    saved = cls.from_pretrained(directory, dtype=torch.float32).eval()
    ids = torch.randint(0, config.vocab_size, (2, SEQ), generator=generator)
    (out / f"{name}.tokens.json").write_text(json.dumps({"input_ids": ids.tolist()}) + "\n")
    (out / f"{name}.nll.json").write_text(json.dumps({"nll": nll(saved, ids).tolist()}) + "\n")


def main(out):
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    # Weights 10× transformers' default scale: sharp attention and logits far from uniform, so
    # that a misplaced row or a wrong ε moves the NLL well past the tests' tolerance.
    common = dict(
        vocab_size=VOCAB, max_position_embeddings=64, hidden_size=64, intermediate_size=96, initializer_range=0.2
    )
    case(
        out,
        "llama_gqa",
        LlamaForCausalLM,
        LlamaConfig(
            **common,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            rms_norm_eps=1e-2,
            rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
            tie_word_embeddings=False,
        ),
        seed=1,
        dtype=torch.bfloat16,
        shard="100KB",
    )
    case(
        out,
        "diffllama_mha",
        DiffLlamaForCausalLM,
        DiffLlamaConfig(
            **common,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            tie_word_embeddings=True,
        ),
        seed=2,
        with_tokenizer=True,
    )
    case(
        out,
        "diffllama_gqa",
        DiffLlamaForCausalLM,
        DiffLlamaConfig(
            **common,
            num_hidden_layers=3,
            num_attention_heads=8,
            num_key_value_heads=4,
            rms_norm_eps=0.05,
        ),
        seed=3,
    )


if __name__ == "__main__":
    main(sys.argv[1])
