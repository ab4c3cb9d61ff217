"""transformers' side of bench/generate.sh: greedy `generate` with its KV cache on an exported
diffzoo model, timed the way `diffzoo generate --json` times itself, printed as one JSON object.

Prefill is one forward pass over the prompt with the cache on; decoding is the rest of a
`generate` call that makes exactly --max-tokens new tokens (end-of-text suppressed, as
`diffzoo generate --ignore-eot` goes past it): (max_tokens - 1) forward passes of one token.
Medians over --reps after one untimed call of each.

    python bench/generate_hf.py EXPORT_DIR --prompt "…" --max-tokens 128 --threads 2
"""

import argparse
import json
import statistics
import time

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--max-tokens", type=int, required=True)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(args.model, trust_remote_code=True)
    model = AutoModelForCausalLM.from_pretrained(args.model, trust_remote_code=True, dtype=torch.float32)
    model.eval()
    ids = tokenizer(args.prompt, return_tensors="pt", add_special_tokens=False).input_ids
    mask = torch.ones_like(ids)

    def prefill():
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask, use_cache=True)

    def generate():
        with torch.no_grad():
            return model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=args.max_tokens,
                min_new_tokens=args.max_tokens,
                do_sample=False,
                use_cache=True,
                pad_token_id=tokenizer.eos_token_id,
            )

    def timed(f):
        start = time.perf_counter()
        out = f()
        return time.perf_counter() - start, out

    prefill()
    generate()
    prefills = [timed(prefill)[0] for _ in range(args.reps)]
    runs = [timed(generate) for _ in range(args.reps)]
    prefill_s = statistics.median(prefills)
    generate_s = statistics.median(t for t, _ in runs)
    tokens = runs[0][1][0, ids.shape[1]:].tolist()
    print(json.dumps({
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "prompt_tokens": ids.shape[1],
        "prefill_tokens_per_sec": ids.shape[1] / prefill_s,
        "decode_tokens_per_sec": (args.max_tokens - 1) / max(generate_s - prefill_s, 1e-9),
        "tokens": tokens,
    }))


if __name__ == "__main__":
    main()
