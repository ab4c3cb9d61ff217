"""Loads a `diffzoo export hf` directory with transformers and scores token ids, for `tests/hf.rs`.

    python tests/hf/check_export.py DIR TOKENS.json

prints one JSON object: the loaded class, `nll` (nll[b][t] = −log p(ids[b][t+1] | ids[b][≤t]),
computed in f32), the ids greedy `generate` appends to the first sequence's first half, and
whether AutoTokenizer loaded the exported tokenizer and encoded then decoded a text exactly.
"""

import json
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def main(directory, tokens):
    directory = Path(directory)
    ids = torch.tensor(json.loads(Path(tokens).read_text())["input_ids"])
    model = AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(ids).logits.float()
        nll = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none"
        ).reshape(ids.shape[0], -1)
        prompt = ids[:1, : ids.shape[1] // 2]
        generated = model.generate(prompt, max_new_tokens=4, do_sample=False, min_new_tokens=4)
    result = {
        "class": type(model).__name__,
        "nll": nll.tolist(),
        "generated": generated[0, prompt.shape[1]:].tolist(),
        "tokenizer": None,
    }
    if (directory / "tokenizer.json").exists():
        tokenizer = AutoTokenizer.from_pretrained(directory, trust_remote_code=True)
        text = "Differential attention, 1234 times."
        result["tokenizer"] = tokenizer.decode(tokenizer.encode(text)) == text and tokenizer.eos_token is not None
    print(json.dumps(result))


if __name__ == "__main__":
    main(*sys.argv[1:])
