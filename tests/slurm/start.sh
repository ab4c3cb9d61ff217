#!/usr/bin/env bash
# Starts a one-node Slurm on this machine for tests/slurm.rs: installs Debian's slurm-wlm and
# munge when missing, writes a slurm.conf for this machine under $DIFFZOO_SLURM (default
# /tmp/diffzoo-slurm), starts munged, slurmctld and slurmd, and waits until the node is idle.
# Needs root (the daemons run as root; no cgroups). Prints the SLURM_CONF to export.
# Stop it with tests/slurm/stop.sh.
set -euo pipefail
root=${DIFFZOO_SLURM:-/tmp/diffzoo-slurm}
if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >/dev/null
fi
mkdir -p "$root"/{state,spool,log}
host=$(hostname -s)
cpus=$(nproc)
memory=$(awk '/MemTotal/ { printf "%d", $2 / 1024 * 0.8 }' /proc/meminfo)
cat > "$root/slurm.conf" <<CONF
ClusterName=diffzoo-test
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# A requeued job waits this long before it starts again (default 120 s).
AuthInfo=cred_expire=20
StateSaveLocation=$root/state
SlurmdSpoolDir=$root/spool
SlurmctldPidFile=$root/slurmctld.pid
SlurmdPidFile=$root/slurmd.pid
SlurmctldLogFile=$root/log/slurmctld.log
SlurmdLogFile=$root/log/slurmd.log
SlurmctldPort=6817
SlurmdPort=6818
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
# diffzoo checkpoints on SIGTERM; give it time before SIGKILL.
KillWait=60
# Finished jobs stay in squeue -t all for an hour (there is no accounting database here).
MinJobAge=3600
SlurmctldTimeout=30
SlurmdTimeout=30
NodeName=$host CPUs=$cpus RealMemory=$memory State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP
CONF
export SLURM_CONF="$root/slurm.conf"
if ! munge -n >/dev/null 2>&1; then
    touch "$root/munged-started"
    mkdir -p /run/munge /var/log/munge /var/lib/munge
    chown munge:munge /run/munge /var/log/munge /var/lib/munge
    [ -s /etc/munge/munge.key ] || runuser -u munge -- /usr/sbin/mungekey --create
    runuser -u munge -- /usr/sbin/munged
    for _ in $(seq 20); do munge -n >/dev/null 2>&1 && break; sleep 0.5; done
fi
# Ours from an earlier start, if still running.
for daemon in slurmd slurmctld; do
    [ -s "$root/$daemon.pid" ] && kill "$(cat "$root/$daemon.pid")" 2>/dev/null && sleep 1
done
slurmctld -f "$SLURM_CONF"
slurmd -f "$SLURM_CONF"
for _ in $(seq 60); do
    if sinfo -h -o '%t' 2>/dev/null | grep -qx idle; then
        echo "export SLURM_CONF=$SLURM_CONF"
        exit 0
    fi
    sleep 1
done
echo "the Slurm node did not become idle; logs in $root/log" >&2
sinfo >&2 || true
exit 1
