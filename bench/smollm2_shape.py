"""A Llama of SmolLM2-135M's shape with random weights, saved by transformers: the fixture of
the Performance chapter's "At a real model's shape" figures (no checkpoint can be downloaded
here; speed does not depend on the weights' values).

30 layers x 576, 9 query / 3 key-value heads, SwiGLU 1,536, vocab 49,152, tied head, RoPE theta
1e5 (SmolLM2-135M's config.json); the tokenizer is copied from TOKENIZER_DIR (any directory
transformers' AutoTokenizer reads, e.g. `diffzoo export hf` of a tiny run): its ids are below
the vocabulary size, so every prompt it encodes is one the model takes.

    python bench/smollm2_shape.py TOKENIZER_DIR OUT_DIR [--seed 0]
"""

import argparse

import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("tokenizer")
    parser.add_argument("out")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        hidden_act="silu",
        max_position_embeddings=8192,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
        initializer_range=0.041666666666666664,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(args.out)
    AutoTokenizer.from_pretrained(args.tokenizer).save_pretrained(args.out)
    parameters = sum(p.numel() for p in model.parameters())
    print(f"{args.out}: {parameters / 1e6:.1f}M parameters")


if __name__ == "__main__":
    main()
