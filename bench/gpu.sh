#!/usr/bin/env bash
# The GPU benchmark, for a machine with an NVIDIA GPU (CUDA driver and toolkit libraries), Rust
# and Python: builds the `cuda` feature (CubeCL CUDA) — plus `tch` when LIBTORCH_CUDA names a
# CUDA LibTorch 2.9.0 — and measures the paper's 830M shape (d 1536, 24 layers, 16 heads, vocab
# 100,288) at sequence 2,048 in bf16: tokens/s of a forward pass and a training step per
# variant, MFU against the GPU's dense bf16 peak, and the same figures of PyTorch eager (CUDA)
# beside them. Results in target/bench-gpu.json and on stdout. Under ten minutes after the build.
# Usage: bash bench/gpu.sh [diffzoo bench options]   (LIBTORCH_CUDA=/path/to/libtorch bash bench/gpu.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
features=cuda
devices=cuda:0
if [ -n "${LIBTORCH_CUDA:-}" ]; then
    features=cuda,tch
    devices=cuda:0,tch-cuda:0
    export LIBTORCH="$LIBTORCH_CUDA"
fi
case "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)" in
    *H200*) gpu=h200 ;;
    *H100*) gpu=h100 ;;
    *A100*) gpu=a100 ;;
    *) gpu=h100; echo "bench gpu: unknown GPU, MFU against the H100's peak" >&2 ;;
esac
bash bench/setup
cargo build --release --features "$features"
./target/release/diffzoo bench --device "$devices" --size paper/size-scaling/830m-diff \
    --seq 2048 --batch 4 --dtype bf16 --warmup 2 --reps 5 --gpu "$gpu" --torch \
    --out target/bench-gpu.json "$@"
