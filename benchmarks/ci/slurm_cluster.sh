#!/usr/bin/env bash
# One-node Slurm cluster on localhost, in a throw-away directory, for CI.
#
#   benchmarks/ci/slurm_cluster.sh install         # find or apt-get install slurm-wlm + munge
#   benchmarks/ci/slurm_cluster.sh up   DIR        # start munged, slurmctld, slurmd; wait until idle
#   benchmarks/ci/slurm_cluster.sh env  DIR        # print `export SLURM_CONF=...` for clients
#   benchmarks/ci/slurm_cluster.sh down DIR        # stop the daemons started by `up` (by pid)
#
# Example (as root, ~15 s after the packages are installed):
#   d=$(mktemp -d); benchmarks/ci/slurm_cluster.sh up "$d"; eval "$(benchmarks/ci/slurm_cluster.sh env "$d")"
#   sbatch --wait examples/slurm/pretrain_cpu.sbatch; benchmarks/ci/slurm_cluster.sh down "$d"
#
# Why these settings: CI runs in a container (often gVisor) without systemd or a
# writable cgroup hierarchy, so process tracking is proctrack/linuxproc (parent-pid
# tree), task/none, no accounting storage and no cgroup plugins. Everything lives in
# DIR (own munge key and socket, own ports), so it never touches a system Slurm.
# Exit status: 0 ok, 1 failure, 3 packages missing and not installable (callers skip).
set -euo pipefail

SLURM_PKGS=(slurm-wlm munge)

die() { echo "slurm_cluster: $*" >&2; exit 1; }

have_binaries() {
    command -v slurmctld >/dev/null && command -v slurmd >/dev/null \
        && command -v sbatch >/dev/null && command -v munged >/dev/null \
        && command -v mungekey >/dev/null
}

cmd_install() {
    if have_binaries; then
        echo "slurm_cluster: found $(slurmctld -V) and $(munged --version 2>&1 | head -1)"
        return 0
    fi
    if [[ $(id -u) -ne 0 ]] || ! command -v apt-get >/dev/null; then
        echo "slurm_cluster: slurm-wlm/munge missing and cannot apt-get install (need root + apt)" >&2
        exit 3
    fi
    echo "slurm_cluster: installing ${SLURM_PKGS[*]} with apt-get" >&2
    if ! { apt-get update -q >/dev/null \
           && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
                "${SLURM_PKGS[@]}" >/dev/null; }; then
        echo "slurm_cluster: apt-get install ${SLURM_PKGS[*]} failed" >&2
        exit 3
    fi
    have_binaries || { echo "slurm_cluster: packages installed but binaries not found" >&2; exit 3; }
}

# Free TCP port on localhost (the kernel picks it; tiny race accepted in CI).
free_port() {
    python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}

write_conf() {
    local dir=$1 host ctl_port d_port node_line
    host=$(hostname -s)
    ctl_port=$(free_port)
    d_port=$(free_port)
    # The node line must describe the real hardware or slurmd drains the node;
    # `slurmd -C` reports it (CPUs, sockets, cores, memory). The daemons talk over
    # 127.0.0.1 even if the host name does not resolve; jobs still see the real name.
    node_line=$(slurmd -C | head -1)
    [[ $node_line == NodeName=* ]] || die "unexpected 'slurmd -C' output: $node_line"
    cat >"$dir/etc/slurm.conf" <<EOF
ClusterName=sbci
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$ctl_port
SlurmdPort=$d_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$dir/run/munge.socket
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool/slurmd.%n
SlurmctldPidFile=$dir/run/slurmctld.pid
SlurmdPidFile=$dir/run/slurmd.%n.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
KillWait=30
InactiveLimit=0
MinJobAge=600
SlurmctldTimeout=30
SlurmdTimeout=60
$node_line NodeAddr=127.0.0.1 State=UNKNOWN
PartitionName=ci Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
EOF
    : >"$dir/etc/cgroup.conf"
}

wait_for() {  # wait_for SECONDS DESCRIPTION CMD...
    local secs=$1 what=$2; shift 2
    local t=0
    until "$@" >/dev/null 2>&1; do
        (( t++ >= secs * 5 )) && return 1
        sleep 0.2
    done
    echo "slurm_cluster: $what ready after ~$(( t / 5 )) s" >&2
}

cmd_up() {
    local dir=${1:?usage: up DIR}
    have_binaries || die "slurm/munge not installed: run '$0 install' first"
    mkdir -p "$dir"/{etc,run,state,spool,log,munge}
    dir=$(cd "$dir" && pwd)
    chmod 700 "$dir/munge"
    # munged refuses keys and directories that others can write.
    mungekey --create --keyfile "$dir/munge/munge.key" --force
    chmod 600 "$dir/munge/munge.key"
    munged --key-file "$dir/munge/munge.key" --socket "$dir/run/munge.socket" \
        --pid-file "$dir/run/munged.pid" --log-file "$dir/log/munged.log" \
        --seed-file "$dir/munge/munged.seed" --force
    wait_for 10 munged munge --socket "$dir/run/munge.socket" -n \
        || die "munged did not start: $(tail -3 "$dir/log/munged.log")"
    write_conf "$dir"
    export SLURM_CONF=$dir/etc/slurm.conf
    slurmctld -f "$SLURM_CONF" || die "slurmctld failed: $(tail -5 "$dir/log/slurmctld.log")"
    wait_for 30 slurmctld scontrol ping \
        || die "slurmctld not answering: $(tail -5 "$dir/log/slurmctld.log")"
    slurmd -f "$SLURM_CONF" || die "slurmd failed: $(tail -5 "$dir/log/slurmd.log")"
    # Idle (not drained/down) means slurmd registered and matches the node line.
    node_idle() { sinfo -h -N -o '%T' | grep -qx idle; }
    if ! wait_for 60 "node idle" node_idle; then
        sinfo -N -l >&2 || true
        tail -5 "$dir/log/slurmd.log" "$dir/log/slurmctld.log" >&2 || true
        die "node did not become idle"
    fi
}

cmd_env() {
    local dir=${1:?usage: env DIR}
    dir=$(cd "$dir" && pwd)
    echo "export SLURM_CONF=$dir/etc/slurm.conf"
}

stop_pidfile() {  # stop_pidfile FILE: TERM the pid it names, then KILL if needed
    local f=$1 pid t
    [[ -s $f ]] || return 0
    pid=$(<"$f")
    kill -TERM "$pid" 2>/dev/null || return 0
    for t in $(seq 50); do
        kill -0 "$pid" 2>/dev/null || return 0
        sleep 0.2
    done
    kill -KILL "$pid" 2>/dev/null || true
}

cmd_down() {
    local dir=${1:?usage: down DIR} f
    [[ -d $dir ]] || return 0
    for f in "$dir"/run/slurmd.*.pid; do stop_pidfile "$f"; done
    stop_pidfile "$dir/run/slurmctld.pid"
    stop_pidfile "$dir/run/munged.pid"
}

case ${1:-} in
    install) cmd_install ;;
    up) cmd_up "${2:-}" ;;
    env) cmd_env "${2:-}" ;;
    down) cmd_down "${2:-}" ;;
    *) echo "usage: $0 {install|up DIR|env DIR|down DIR}" >&2; exit 2 ;;
esac
