#!/usr/bin/env bash
# A one-machine Slurm cluster (munged + slurmctld + slurmd from Debian's slurm-wlm) for trying
# the sbatch scripts in this folder without a real cluster; the multinode tests use it.
#
#   bash scripts/slurm/local_cluster.sh start    # install if missing (root), configure, start, wait idle
#   eval "$(bash scripts/slurm/local_cluster.sh env)"   # SLURM_CONF for sbatch/squeue/sinfo
#   sbatch --nodes=1 ... scripts/slurm/train_grpo.sbatch ...
#   bash scripts/slurm/local_cluster.sh stop     # stop the daemons this script started
#
# Idempotent: `start` with the daemons already up (same config) only waits for the node to be idle.
# Everything lives in $SLURM_LOCAL_DIR (default /var/tmp/search_r1_slurm): slurm.conf, state, spool,
# logs, pid files. The machine's /etc/slurm is not touched. No cgroups (proctrack/linuxproc,
# task/none), no accounting; one node named after `hostname -s` with the CPUs/memory slurmd detects.
set -euo pipefail

dir=${SLURM_LOCAL_DIR:-/var/tmp/search_r1_slurm}
conf=$dir/slurm.conf
ctld_port=${SLURM_LOCAL_CTLD_PORT:-6817}
slurmd_port=${SLURM_LOCAL_SLURMD_PORT:-6818}
wait_s=${SLURM_LOCAL_WAIT_S:-60}
export SLURM_CONF=$conf

die() { echo "local_cluster.sh: $*" >&2; exit 1; }
log() { echo "[local_cluster] $*" >&2; }
alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

install_if_missing() {
    command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null && return 0
    [ "$(id -u)" -eq 0 ] || die "slurm-wlm is not installed and this is not root: apt-get install -y slurm-wlm"
    log "installing slurm-wlm (apt-get)"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm >/dev/null 2>&1 || {
        apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm >/dev/null; } \
        || die "apt-get install slurm-wlm failed"
}

start_munge() {
    if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then return 0; fi
    [ -s /etc/munge/munge.key ] || {
        log "creating /etc/munge/munge.key"
        mkdir -p /etc/munge
        dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
    }
    chown munge:munge /etc/munge/munge.key 2>/dev/null || true
    chmod 400 /etc/munge/munge.key
    mkdir -p /run/munge /var/log/munge /var/lib/munge
    chown munge:munge /run/munge /var/log/munge /var/lib/munge 2>/dev/null || true
    if id munge >/dev/null 2>&1; then
        su -s /bin/sh munge -c munged 2>/dev/null || munged --force
    else
        munged --force
    fi
    for _ in $(seq 20); do
        munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && return 0
        sleep 0.5
    done
    die "munged does not answer (munge -n | unmunge fails); see /var/log/munge/munged.log"
}

write_conf() {
    local host node_line mem tmp
    host=$(hostname -s)
    # slurmd -C prints this machine's NodeName line (CPUs, sockets, cores, threads, RealMemory).
    node_line=$(slurmd -C 2>/dev/null | grep '^NodeName=') || die "slurmd -C failed"
    mem=$(sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p' <<<"$node_line")
    # Declare a little less memory than detected, so a few MB of drift never drains the node.
    node_line=$(sed "s/RealMemory=[0-9]*/RealMemory=$((mem * 9 / 10))/; s/^NodeName=[^ ]*/NodeName=$host/" <<<"$node_line")
    mkdir -p "$dir/state" "$dir/spool" "$dir/log"
    tmp=$(mktemp "$dir/slurm.conf.XXXX")
    cat >"$tmp" <<EOF
# Written by scripts/slurm/local_cluster.sh: a one-machine Slurm cluster.
ClusterName=searchr1
SlurmctldHost=$host
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
MpiDefault=none
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
ReturnToService=2
SlurmctldTimeout=30
SlurmdTimeout=60
InactiveLimit=0
KillWait=30
MinJobAge=600
$node_line NodeAddr=127.0.0.1 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
    if [ -f "$conf" ] && cmp -s "$tmp" "$conf"; then rm -f "$tmp"; return 1; fi
    mv "$tmp" "$conf"
    return 0
}

node_state() { sinfo -h -N -o '%T' 2>/dev/null | head -n1; }

start() {
    install_if_missing
    start_munge
    local changed=0
    write_conf && changed=1
    if [ "$changed" -eq 1 ] && { alive "$dir/slurmctld.pid" || alive "$dir/slurmd.pid"; }; then
        log "slurm.conf changed: restarting the daemons"
        stop_daemons
    fi
    if ! alive "$dir/slurmctld.pid"; then
        log "starting slurmctld"
        slurmctld -f "$conf" || die "slurmctld failed to start: $(tail -n 20 "$dir/log/slurmctld.log" 2>/dev/null)"
    fi
    if ! alive "$dir/slurmd.pid"; then
        log "starting slurmd"
        slurmd -f "$conf" || die "slurmd failed to start: $(tail -n 20 "$dir/log/slurmd.log" 2>/dev/null)"
    fi
    local state="" deadline=$((SECONDS + wait_s))
    while [ "$SECONDS" -lt "$deadline" ]; do
        state=$(node_state)
        case "$state" in
            idle|mixed|allocated) log "node $(hostname -s) is $state"; return 0 ;;
            down*|drain*|fail*)
                scontrol update nodename="$(hostname -s)" state=resume >/dev/null 2>&1 || true ;;
        esac
        sleep 1
    done
    die "the Slurm node is not idle after ${wait_s}s (state '${state:-none}');" \
        "slurmctld: $(tail -n 5 "$dir/log/slurmctld.log" 2>/dev/null) slurmd: $(tail -n 5 "$dir/log/slurmd.log" 2>/dev/null)"
}

stop_daemons() {
    local name pidfile pid
    for name in slurmd slurmctld; do
        pidfile=$dir/$name.pid
        if alive "$pidfile"; then
            pid=$(cat "$pidfile")
            kill "$pid"
            for _ in $(seq 30); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
            kill -0 "$pid" 2>/dev/null && kill -9 "$pid"
            log "stopped $name ($pid)"
        fi
        rm -f "$pidfile"
    done
}

case "${1:-start}" in
    start) start ;;
    stop) stop_daemons ;;
    env) echo "export SLURM_CONF=$conf" ;;
    status) alive "$dir/slurmctld.pid" && alive "$dir/slurmd.pid" && sinfo ;;
    *) die "usage: local_cluster.sh start|stop|env|status" ;;
esac
