#!/usr/bin/env bash
# Long-context training memory and speed: `diffzoo bench` steps of the d 256 × 4-layer model at
# batch 1 for growing sequence lengths, through the explicit attention path (where its S×S maps
# fit), the flash path, and the flash path with blocks recomputed, one line of JSON per
# measurement in target/bench-long-context.jsonl.
#   bash bench/long_context.sh [DEVICE] [VARIANTS] [LENGTHS] [EXPLICIT_UP_TO]
# DIFFZOO names the binary (default: a release build).
set -euo pipefail
cd "$(dirname "$0")/.."
device=${1:-flex}
variants=${2:-transformer,diff,diff-v2}
lengths=${3:-512 1024 2048 4096 8192 16384}
explicit_up_to=${4:-4096}
diffzoo=${DIFFZOO:-}
if [ -z "$diffzoo" ]; then
    cargo build --release
    diffzoo=target/release/diffzoo
fi
out=target/bench-long-context.jsonl
: > "$out"
measure() { # impl seq batch reps [recompute]
    local reps=$4 warmup=1 recompute=${5:-none}
    [ "$2" -ge 8192 ] && warmup=0
    "$diffzoo" bench --device "$device" --attention "$variants" --size 256x4x4 --seq "$2" \
        --batch "$3" --reps "$reps" --warmup "$warmup" --attention-impl "$1" \
        --recompute "$recompute" --json |
        jq -c --arg impl "$1" '{cpu, impl: $impl, recompute, seq, batch} + (.rows[] | {device, attention, step_tokens_per_sec, forward_tokens_per_sec, peak_mib: (if .peak_bytes then (.peak_bytes / 1048576 | floor) else null end)})' |
        tee -a "$out"
}
# The default bench shape (8 × 256): the speed ratio at short sequences.
for impl in explicit flash; do measure "$impl" 256 8 3; done
for seq in $lengths; do
    [ "$seq" -le "$explicit_up_to" ] && measure explicit "$seq" 1 1
    measure flash "$seq" 1 1
    measure flash "$seq" 1 1 block
done
