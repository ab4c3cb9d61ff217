"""Writes the Hugging Face fixtures `tests/hf.rs` imports: tiny random checkpoints made and saved by
transformers itself, with the per-token NLL transformers computes on fixed token ids.

    tests/hf/fixtures/<case>/            config.json, weights (and tokenizer files) as saved
    tests/hf/fixtures/<case>.tokens.json {"input_ids": [[...], ...]}, what `eval ppl --tokens` reads
    tests/hf/fixtures/<case>.nll.json    {"nll": [[...], ...]}, nll[b][t] = −log p(ids[b][t+1] | ids[b][≤t])
    tests/hf/fixtures/<case>.chat.json   chat cases: {"conversations", "text", "ids"}, what
                                         `apply_chat_template(..., add_generation_prompt=True)` gives

Cases: llama_gqa (LlamaForCausalLM, GQA, bf16, sharded, rope θ 5e5, ε 1e-2), diffllama_mha
(DiffLlamaForCausalLM, tied embeddings, with a tokenizer) and diffllama_gqa (3 layers, GQA,
ε 0.05); the real-model families: llama3_tied (Llama 3.1's `llama3` RoPE scaling, tied
embeddings, a Llama 3 style chat template in chat_template.jinja and end-of-turn ids in
generation_config.json), qwen2_bias (Qwen2ForCausalLM: non-zero q/k/v biases, head_dim 24 ≠
hidden/heads, a ChatML template in tokenizer_config.json as older transformers saved it),
mistral_window (MistralForCausalLM, a sliding window as long as the context) and gguf_llama (a
Llama whose config carries what a GGUF conversion writes: `_model_name_or_path`, `unk_token_id`,
an f32 ε). The large ε make a norm that ignores `rms_norm_eps` visible in the NLL.
Norm weights, λ vectors and biases are drawn away from their initial values, and the other
weights are large, so that a mapping that drops or misplaces anything changes the NLL.

Regenerate with (a venv holding torch and transformers, e.g. the one `bash .ci/setup hf` makes):

    target/torch-venv/bin/python tests/hf/make_fixtures.py tests/hf/fixtures

(or `$DIFFZOO_PYTHON` where `.ci/run` keeps it).
"""

import json
import shutil
import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    DiffLlamaConfig,
    DiffLlamaForCausalLM,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

HERE = Path(__file__).parent

VOCAB = 300
SEQ = 20

TEXT = [
    "Differential attention cancels noise the way a differential amplifier does.",
    "The quick brown fox jumps over the lazy dog, 1234567890 times.",
    "Shall I compare thee to a summer's day? Thou art more lovely and more temperate.",
] * 20


# Multi-turn conversations with and without a system message, for the chat templates.
CONVERSATIONS = [
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is differential attention?"},
        {"role": "assistant", "content": "Two softmax maps, one subtracted."},
        {"role": "user", "content": "  And lambda?  "},
    ],
    [{"role": "user", "content": "Héllo — ünïcode 1234"}],
    [
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Salut"},
        {"role": "user", "content": "Bye"},
        {"role": "assistant", "content": "Au revoir"},
        {"role": "user", "content": "Thanks"},
    ],
]

LLAMA3_SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
CHATML_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def tokenizer(special=("<|endoftext|>",)):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=list(special),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(TEXT, trainer)
    return tok


def chat_files(directory, name, special, template, bos, eos, stops, in_config):
    """A tokenizer with `special` tokens and the chat template `template` saved by transformers
    into `directory` (moved into tokenizer_config.json with `in_config`, as transformers 4 kept
    it), `stops` as generation_config.json's end-of-turn ids, and the golden renderings."""
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer(special), bos_token=bos, eos_token=eos)
    fast.chat_template = (HERE / "templates" / template).read_text()
    fast.save_pretrained(directory)
    if in_config:
        jinja = directory / "chat_template.jinja"
        config = json.loads((directory / "tokenizer_config.json").read_text())
        config["chat_template"] = jinja.read_text()
        (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
        jinja.unlink()
    generation = GenerationConfig(eos_token_id=[fast.convert_tokens_to_ids(t) for t in stops])
    generation.save_pretrained(directory)
    saved = PreTrainedTokenizerFast.from_pretrained(directory)
    assert saved.chat_template == fast.chat_template
    text = [saved.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in CONVERSATIONS]
    ids = [saved(t, add_special_tokens=False)["input_ids"] for t in text]
    direct = [saved.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"] for c in CONVERSATIONS]
    assert ids == direct, "apply_chat_template tokenizes without adding special tokens"
    chat = {"conversations": CONVERSATIONS, "text": text, "ids": ids}
    (directory.parent / f"{name}.chat.json").write_text(json.dumps(chat, ensure_ascii=False) + "\n")


def perturb(model, generator):
    """Moves every norm weight, λ vector and bias off its initial value."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=generator))
            elif "lambda_" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=generator))
            elif name.endswith(".bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=generator))


def nll(model, ids):
    with torch.no_grad():
        logits = model(ids).logits.float()
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none"
    ).reshape(ids.shape[0], -1)


def case(out, name, cls, config, seed, dtype=torch.float32, shard=None, with_tokenizer=False, chat=None, extra=None):
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
    if chat:
        chat_files(directory, name, **chat)
    if extra:
        config_path = directory / "config.json"
        saved_config = json.loads(config_path.read_text())
        saved_config.update(extra)
        config_path.write_text(json.dumps(saved_config, indent=2) + "\n")
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
    # Chat needs room: a conversation of this 300-token vocabulary takes 50–150 positions.
    chat = {**common, "max_position_embeddings": 256}
    case(
        out,
        "llama3_tied",
        LlamaForCausalLM,
        LlamaConfig(
            **chat,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            rms_norm_eps=1e-2,
            # Wavelengths above 16 positions interpolated 8×, below 4 kept: most of a head's.
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
            tie_word_embeddings=True,
        ),
        seed=4,
        chat=dict(
            special=LLAMA3_SPECIAL,
            template="llama3.jinja",
            bos="<|begin_of_text|>",
            eos="<|eot_id|>",
            stops=["<|end_of_text|>", "<|eot_id|>"],
            in_config=False,
        ),
    )
    case(
        out,
        "qwen2_bias",
        Qwen2ForCausalLM,
        Qwen2Config(
            **chat,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=24,
            rms_norm_eps=1e-2,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            use_sliding_window=False,
            tie_word_embeddings=False,
        ),
        seed=5,
        chat=dict(
            special=CHATML_SPECIAL,
            template="chatml.jinja",
            bos=None,
            eos="<|im_end|>",
            stops=["<|im_end|>"],
            in_config=True,
        ),
    )
    case(
        out,
        "mistral_window",
        MistralForCausalLM,
        MistralConfig(
            **common,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            rms_norm_eps=1e-2,
            sliding_window=64,
            tie_word_embeddings=False,
        ),
        seed=6,
    )
    case(
        out,
        "gguf_llama",
        LlamaForCausalLM,
        LlamaConfig(
            **common,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            rms_norm_eps=9.999999747378752e-06,
            rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
            tie_word_embeddings=False,
        ),
        seed=7,
        with_tokenizer=True,
        # What transformers writes when it converts a GGUF file, and reads none of.
        extra={"_model_name_or_path": "/models/smollm2-135m-instruct-q8_0.gguf", "unk_token_id": 0},
    )


if __name__ == "__main__":
    main(sys.argv[1])
