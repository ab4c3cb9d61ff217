#!/usr/bin/env bash
# Stops what tests/slurm/start.sh started (slurmd, slurmctld, and munged if it started it) and
# removes its state. Daemons it did not start are left alone.
root=${DIFFZOO_SLURM:-/tmp/diffzoo-slurm}
pids=()
for daemon in slurmd slurmctld; do
    [ -s "$root/$daemon.pid" ] && pids+=("$(cat "$root/$daemon.pid")")
done
if [ -e "$root/munged-started" ] && [ -s /run/munge/munged.pid ]; then
    pids+=("$(cat /run/munge/munged.pid)")
fi
for pid in "${pids[@]}"; do
    kill "$pid" 2>/dev/null
done
for _ in $(seq 40); do
    alive=0
    for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
    [ "$alive" -eq 0 ] && break
    sleep 0.25
done
rm -rf "$root"
exit 0
