#!/usr/bin/env bash
# Generation speed on the CPU: diffzoo's KV-cache decoding beside transformers' `generate` with
# its cache, on the same weights, prompt and number of new tokens, measured in one run.
# Each variant is the tiny recipe's model (d 256, 4 layers) after one training step, exported
# with `diffzoo export hf`; `diffzoo generate --temperature 0 --ignore-eot --warmup 1 --json`
# (median of 3 runs) and bench/generate_hf.py (one untimed call each, median of 3) give prefill
# and decode tokens/s. One JSON line per
# variant in target/bench-generate.jsonl, with diffzoo / transformers ratios and each variant's
# decode time per token over the baseline's.
#   bash bench/generate.sh [NEW_TOKENS] [PROMPT_REPEATS] [VARIANTS]
# DIFFZOO names the binary (default: a release build); DIFFZOO_PYTHON a Python with torch and
# transformers (default: target/torch-venv/bin/python, made by `bash .ci/setup hf`).
set -euo pipefail
cd "$(dirname "$0")/.."
new_tokens=${1:-128}
repeats=${2:-8}
variants=${3:-transformer diff diff-v2}
reps=3
threads=${THREADS:-$(nproc)}
diffzoo=${DIFFZOO:-}
if [ -z "$diffzoo" ]; then
    cargo build --release
    diffzoo=target/release/diffzoo
fi
python=${DIFFZOO_PYTHON:-target/torch-venv/bin/python}
work=target/bench-generate
out=target/bench-generate.jsonl
rm -rf "$work"
mkdir -p "$work"
: > "$out"
prompt=$(for _ in $(seq "$repeats"); do printf 'Two households, both alike in dignity, In fair Verona, where we lay our scene, '; done)
export RAYON_NUM_THREADS=$threads OMP_NUM_THREADS=$threads
for variant in $variants; do
    run=$work/$variant
    "$diffzoo" train --recipe tiny --out "$run" --no-dashboard --set "model.attention=\"$variant\"" \
        --set model.max_seq_len=1024 --set training.steps=1 --set schedule.warmup_steps=0 >/dev/null
    "$diffzoo" export hf "$run" --out "$run-hf" >/dev/null
    for _ in $(seq "$reps"); do
        "$diffzoo" generate --run "$run" --prompt "$prompt" --max-tokens "$new_tokens" \
            --temperature 0 --ignore-eot --warmup 1 --json
    done | jq -s '{
        prompt_tokens: .[0].timings.prompt_tokens,
        tokens: .[0].generations[0].tokens,
        prefill: ([.[].timings.prefill_tokens_per_sec] | sort | .[length / 2 | floor]),
        decode: ([.[].timings.decode_tokens_per_sec] | sort | .[length / 2 | floor])
    }' > "$work/$variant-ours.json"
    "$python" bench/generate_hf.py "$run-hf" --prompt "$prompt" --max-tokens "$new_tokens" \
        --threads "$threads" --reps "$reps" | tail -n 1 > "$work/$variant-theirs.json"
    jq -c -n --arg variant "$variant" --arg cpu "$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | xargs)" \
        --slurpfile ours "$work/$variant-ours.json" --slurpfile theirs "$work/$variant-theirs.json" '
        $ours[0] as $o | $theirs[0] as $t | {
            variant: $variant, cpu: $cpu, threads: $t.threads, transformers: $t.transformers,
            prompt_tokens: $o.prompt_tokens, same_prompt: ($o.prompt_tokens == $t.prompt_tokens),
            new_tokens: ($o.tokens | length), same_tokens: ($o.tokens == $t.tokens),
            prefill_tps: $o.prefill, decode_tps: $o.decode,
            hf_prefill_tps: $t.prefill_tokens_per_sec, hf_decode_tps: $t.decode_tokens_per_sec,
            prefill_vs_hf: ($o.prefill / $t.prefill_tokens_per_sec),
            decode_vs_hf: ($o.decode / $t.decode_tokens_per_sec)
        }' | tee -a "$out"
done
# Decode time per token over the baseline's (DIFF's target: at most 1.10).
jq -s -c '(map(select(.variant == "transformer"))[0].decode_tps) as $base |
    .[] | {variant, decode_time_vs_transformer: (if $base then $base / .decode_tps else null end)}' "$out"
