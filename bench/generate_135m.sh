#!/usr/bin/env bash
# Generation at a real model's shape: a random Llama of SmolLM2-135M's shape
# (bench/smollm2_shape.py, saved by transformers), imported twice (`diffzoo import hf`, f32 and
# `--dtype bf16`), decoded greedily by `diffzoo generate --temperature 0 --ignore-eot --warmup 1
# --json` with f32 weights and cache, and bf16 weights and cache (`--cache-dtype bf16`; REPS
# interleaved pairs, 5 by default, medians reported) beside transformers' `generate` on the same
# weights (bench/generate_hf.py, f32, median of 3), for a short and a long prompt, in one run.
# In target/bench-generate-135m.jsonl, per prompt: one JSON line per weight dtype, with
# diffzoo / transformers ratios, whether the greedy tokens are transformers' and the most cores
# other processes took during a run; then one line of bf16 / f32 decode ratios, one per pair,
# with their median and range and how many pairs ran beside another busy process.
#   [REPS=5] bash bench/generate_135m.sh [NEW_TOKENS] [LONG_PROMPT_REPEATS]
# DIFFZOO names the binary (default: a release build); DIFFZOO_PYTHON a Python with torch and
# transformers (default: target/torch-venv/bin/python, made by `bash .ci/setup hf`).
set -euo pipefail
cd "$(dirname "$0")/.."
new_tokens=${1:-64}
repeats=${2:-60}
reps=${REPS:-5}
case $reps in
    '' | *[!0-9]* | 0) echo "REPS=$reps: give a positive number of pairs" >&2; exit 2 ;;
esac
threads=${THREADS:-$(nproc)}
diffzoo=${DIFFZOO:-}
if [ -z "$diffzoo" ]; then
    cargo build --release
    diffzoo=${CARGO_TARGET_DIR:-target}/release/diffzoo
fi
python=${DIFFZOO_PYTHON:-target/torch-venv/bin/python}
work=target/bench-generate-135m
out=target/bench-generate-135m.jsonl
rm -rf "$work"
mkdir -p "$work"
: > "$out"
export RAYON_NUM_THREADS=$threads OMP_NUM_THREADS=$threads
# The tokenizer: the tiny recipe's, through a one-step run exported for transformers.
"$diffzoo" train --recipe tiny --out "$work/tiny" --no-dashboard --set training.steps=1 \
    --set schedule.warmup_steps=0 >/dev/null
"$diffzoo" export hf "$work/tiny" --out "$work/tiny-hf" >/dev/null
"$python" bench/smollm2_shape.py "$work/tiny-hf" "$work/hf" >&2
"$diffzoo" import hf "$work/hf" --out "$work/f32" >/dev/null
"$diffzoo" import hf "$work/hf" --out "$work/bf16" --dtype bf16 >/dev/null
short="Two households, both alike in dignity, In fair Verona, where we lay our scene, "
long=$(for _ in $(seq "$repeats"); do printf '%s' "$short"; done)
cpu=$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | xargs)
for name in short long; do
    prompt=${!name}
    "$python" bench/generate_hf.py "$work/hf" --prompt "$prompt" --max-tokens "$new_tokens" \
        --threads "$threads" --reps 3 | tail -n 1 > "$work/$name-theirs.json"
    # f32 and bf16 in interleaved pairs, each pair's order alternating: a drift of the machine's
    # speed over the run reaches both dtypes alike, and each pair gives one bf16 / f32 ratio.
    rm -f "$work/$name-f32.jsonl" "$work/$name-bf16.jsonl"
    for rep in $(seq "$reps"); do
        order="f32 bf16"
        if [ $((rep % 2)) -eq 0 ]; then order="bf16 f32"; fi
        for dtype in $order; do
            "$diffzoo" generate --run "$work/$dtype" --prompt "$prompt" --max-tokens "$new_tokens" \
                --temperature 0 --ignore-eot --warmup 1 --dtype "$dtype" --cache-dtype "$dtype" \
                --json | jq -c . >> "$work/$name-$dtype.jsonl"
        done
    done
    for dtype in f32 bf16; do
        jq -s '{
            prompt_tokens: .[0].timings.prompt_tokens,
            tokens: .[0].generations[0].tokens,
            prefill: ([.[].timings.prefill_tokens_per_sec] | sort | .[length / 2 | floor]),
            decode: ([.[].timings.decode_tokens_per_sec] | sort | .[length / 2 | floor]),
            decode_min: ([.[].timings.decode_tokens_per_sec] | min),
            decode_max: ([.[].timings.decode_tokens_per_sec] | max),
            competing: ([.[].timings.competing_cores // 0] | max)
        }' "$work/$name-$dtype.jsonl" > "$work/$name-$dtype.json"
        jq -c -n --arg prompt "$name" --arg dtype "$dtype" --arg cpu "$cpu" \
            --slurpfile ours "$work/$name-$dtype.json" --slurpfile theirs "$work/$name-theirs.json" '
            $ours[0] as $o | $theirs[0] as $t | {
                prompt: $prompt, weights: $dtype, cpu: $cpu, threads: $t.threads,
                transformers: $t.transformers, prompt_tokens: $o.prompt_tokens,
                same_prompt: ($o.prompt_tokens == $t.prompt_tokens),
                new_tokens: ($o.tokens | length), same_tokens: ($o.tokens == $t.tokens),
                prefill_tps: $o.prefill, decode_tps: $o.decode,
                decode_tps_range: [$o.decode_min, $o.decode_max],
                competing_cores_max: $o.competing,
                hf_prefill_tps: $t.prefill_tokens_per_sec, hf_decode_tps: $t.decode_tokens_per_sec,
                prefill_vs_hf: ($o.prefill / $t.prefill_tokens_per_sec),
                decode_vs_hf: ($o.decode / $t.decode_tokens_per_sec)
            }' | tee -a "$out"
    done
    # bf16 / f32 decode speed of each pair, and their median (the middle two's mean for an even
    # count); pairs where either run warned of another process on the cores (`generate`'s
    # `warnings`) are counted, not left out.
    jq -c -n --arg prompt "$name" --arg cpu "$cpu" \
        --slurpfile f32 "$work/$name-f32.jsonl" --slurpfile bf16 "$work/$name-bf16.jsonl" '
        [range($f32 | length) | {
            ratio: ($bf16[.].timings.decode_tokens_per_sec / $f32[.].timings.decode_tokens_per_sec),
            contended: ([$f32[.], $bf16[.]] | any(.warnings | length > 0))
        }] as $pairs | ($pairs | map(.ratio) | sort) as $r | ($r | length) as $n | {
            prompt: $prompt, cpu: $cpu,
            bf16_vs_f32_decode: (($r[($n - 1) / 2 | floor] + $r[$n / 2 | floor]) / 2),
            bf16_vs_f32_range: [$r[0], $r[-1]], pairs: ($pairs | length),
            contended_pairs: ($pairs | map(select(.contended)) | length),
            ratios: ($pairs | map(.ratio))
        }' | tee -a "$out"
done
