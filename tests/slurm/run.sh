#!/usr/bin/env bash
# The Slurm suite (tests/slurm.rs) against a real one-node Slurm on this machine: starts it
# (tests/slurm/start.sh installs slurm-wlm and munge when missing; needs root), runs the
# ignored tests one at a time, and stops it whatever happened. About 10 minutes once the
# tests are built. From the repository root: bash tests/slurm/run.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
export DIFFZOO_CACHE=${DIFFZOO_CACHE:-$PWD/target/diffzoo-cache}
trap 'bash tests/slurm/stop.sh' EXIT
conf=$(bash tests/slurm/start.sh)
eval "$conf"
cargo test --workspace --features wgpu,tch --test slurm -- --ignored --test-threads=1
