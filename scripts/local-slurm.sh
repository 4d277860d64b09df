#!/usr/bin/env bash
# Run a real, local Slurm cluster of 4 fake nodes (n1..n4) on loopback on this
# single machine, for development and CI.
#
#   sudo bash scripts/local-slurm.sh start    # install (if needed) + start, wait until healthy
#   sudo bash scripts/local-slurm.sh status   # exit 0 iff controller + 4 nodes are healthy
#   sudo bash scripts/local-slurm.sh stop     # stop only the daemons this script started
#
# Target: Debian 12 (Slurm 22.05 packages), run as root, no systemd needed.
# One slurmctld plus four slurmd processes (`slurmd -N nX`; Debian builds
# Slurm with multiple-slurmd support) each bound to its own 127.0.1.X address
# and port.  No accounting database: `sacct` does not work, by design.
#
# Environment knobs:
#   RLTOOLS_SLURM_TIMEOUT  seconds to wait for the cluster to become healthy (default 60)
set -euo pipefail

NODES=(n1 n2 n3 n4)
NODE_RANGE="n[1-4]"
SLURM_PKGS=(slurmctld slurmd slurm-client munge)
TIMEOUT="${RLTOOLS_SLURM_TIMEOUT:-60}"

# PIDs of the daemons this script started live here; `stop` kills only those.
# /run is cleared on reboot, which is exactly when the recorded PIDs go stale.
STATE_DIR=/run/rltools-slurm
LOG_DIR=/var/log/slurm
SLURM_CONF_FILE=/etc/slurm/slurm.conf
CTLD_STATE_DIR=/var/spool/slurmctld
SLURMD_SPOOL_ROOT=/var/spool/slurmd
MUNGE_KEY=/etc/munge/munge.key
HOSTS_BEGIN="# BEGIN rltools local-slurm nodes"
HOSTS_END="# END rltools local-slurm nodes"
CONF_MARKER="# Managed by rltools scripts/local-slurm.sh"

# Make every slurm command (and the daemons we start) use our config, even if
# the caller's environment points SLURM_CONF somewhere else.
export SLURM_CONF="$SLURM_CONF_FILE"

log() { echo "local-slurm: $*"; }
die() { echo "local-slurm: ERROR: $*" >&2; exit 1; }

usage() {
    echo "usage: $0 start|stop|status" >&2
    exit 2
}

require_root() {
    if [[ "$(id -u)" -ne 0 ]]; then
        echo "local-slurm: ERROR: must run as root (it installs packages, writes /etc/slurm and /etc/hosts, and starts daemons); try: sudo bash $0 ${1:-start}" >&2
        exit 1
    fi
}

# ---------------------------------------------------------------------------
# Process bookkeeping
# ---------------------------------------------------------------------------

# pid_matches PID COMM [ARG...]: true if PID is alive, its command name is
# COMM and its argv contains all ARGs.  Guards against PID reuse: a stale PID
# file must never make us signal an unrelated process.
pid_matches() {
    local pid="$1" comm="$2"; shift 2
    [[ "$pid" =~ ^[0-9]+$ ]] || return 1
    [[ -r "/proc/$pid/comm" ]] || return 1
    [[ "$(cat "/proc/$pid/comm" 2>/dev/null)" == "$comm" ]] || return 1
    local argv
    argv=" $(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null || true) "
    local a
    for a in "$@"; do
        [[ "$argv" == *" $a "* ]] || return 1
    done
    return 0
}

# tracked_pid NAME COMM [ARG...]: print the recorded PID of daemon NAME if that
# process is still the one we started; otherwise drop the stale record.
tracked_pid() {
    local name="$1"; shift
    local f="$STATE_DIR/$name.pid" pid
    [[ -f "$f" ]] || return 1
    pid="$(cat "$f" 2>/dev/null || true)"
    if pid_matches "$pid" "$@"; then
        echo "$pid"
        return 0
    fi
    rm -f "$f"
    return 1
}

ctld_pid()   { tracked_pid slurmctld slurmctld; }
slurmd_pid() { tracked_pid "slurmd-$1" slurmd -N "$1"; }
munged_pid() { tracked_pid munged munged; }

# pids_by_comm COMM: all PIDs whose command name is COMM (diagnostics only;
# we never kill by name).
pids_by_comm() {
    local p out=()
    for p in /proc/[0-9]*; do
        [[ "$(cat "$p/comm" 2>/dev/null || true)" == "$1" ]] && out+=("${p#/proc/}")
    done
    echo "${out[*]:-}"
}

# launch NAME COMM CMD...: start CMD in the foreground mode of the daemon,
# detached in its own session, and record its PID.  setsid (and setpriv) exec
# directly (we are not a process-group leader), so $! becomes the daemon's own
# PID - but only once those execs are done: for a few milliseconds its command
# name is still "bash" or "setsid", and tracked_pid would take the daemon for
# dead and drop its record.  So wait until the PID shows COMM (or is gone).
# In foreground mode the daemons echo their log to stderr as well; that copy
# is truncated on each launch and mainly catches errors from before the log
# file is opened (e.g. config parse errors).
launch() {
    local name="$1" comm="$2"; shift 2
    mkdir -p "$STATE_DIR" "$LOG_DIR"
    setsid "$@" </dev/null >"$LOG_DIR/$name.stderr" 2>&1 &
    local pid=$! i now
    echo "$pid" >"$STATE_DIR/$name.pid"
    for ((i = 0; i < 100; i++)); do
        now="$(cat "/proc/$pid/comm" 2>/dev/null || true)"
        [[ "$now" == "$comm" || -z "$now" ]] && return 0
        sleep 0.05
    done
    die "$name (pid $pid) did not exec $comm within 5 s; see $LOG_DIR/$name.stderr"
}

# stop_pids NAME=PID...: SIGTERM all at once (each daemon takes ~2 s to shut
# down, so signalling them in parallel keeps `stop` fast), wait up to 30 s,
# then SIGKILL whatever is left.
stop_pids() {
    local item name pid i alive
    for item in "$@"; do
        name="${item%%=*}"; pid="${item#*=}"
        log "stopping $name (pid $pid)"
        kill -TERM "$pid" 2>/dev/null || true
    done
    for ((i = 0; i < 300; i++)); do
        alive=0
        for item in "$@"; do
            kill -0 "${item#*=}" 2>/dev/null && alive=1
        done
        [[ "$alive" -eq 0 ]] && break
        sleep 0.1
    done
    for item in "$@"; do
        name="${item%%=*}"; pid="${item#*=}"
        if kill -0 "$pid" 2>/dev/null; then
            log "$name (pid $pid) ignored SIGTERM for 30 s; sending SIGKILL"
            kill -KILL "$pid" 2>/dev/null || true
        fi
    done
    for ((i = 0; i < 50; i++)); do
        alive=0
        for item in "$@"; do
            kill -0 "${item#*=}" 2>/dev/null && alive=1
        done
        [[ "$alive" -eq 0 ]] && break
        sleep 0.1
    done
    for item in "$@"; do
        rm -f "$STATE_DIR/${item%%=*}.pid"
    done
}

# ---------------------------------------------------------------------------
# Health checks
# ---------------------------------------------------------------------------

munge_ok() { munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; }

ctld_responding() { scontrol ping 2>/dev/null | grep -q 'is UP'; }

# "node state" lines for our nodes, e.g. "n1 idle", "n3 down*", "n2 drained".
node_states() { sinfo -h -N -n "$NODE_RANGE" -o '%N %T' 2>/dev/null | sort -u; }

# A node is usable if it responds and is not down/drained.  mixed/allocated
# count too, so `start` on a cluster that is running jobs reports it as up.
nodes_healthy() {
    local states n ok=0
    states="$(node_states)" || return 1
    for n in "${NODES[@]}"; do
        if grep -Eq "^$n (idle|mixed|allocated|completing)$" <<<"$states"; then
            ok=$((ok + 1))
        fi
    done
    [[ "$ok" -eq "${#NODES[@]}" ]]
}

all_daemons_tracked() {
    local n
    ctld_pid >/dev/null || return 1
    for n in "${NODES[@]}"; do
        slurmd_pid "$n" >/dev/null || return 1
    done
}

any_slurm_daemon_tracked() {
    local n
    ctld_pid >/dev/null && return 0
    for n in "${NODES[@]}"; do
        slurmd_pid "$n" >/dev/null && return 0
    done
    return 1
}

log_pointers() {
    echo "  logs: $LOG_DIR/slurmctld.log, $LOG_DIR/slurmd-n{1..4}.log," \
         "$LOG_DIR/*.stderr (daemon stderr; munged.stderr is munged's only log)" >&2
    echo "  daemons that did start are left running; '$0 stop' stops them" >&2
}

# ---------------------------------------------------------------------------
# start
# ---------------------------------------------------------------------------

install_packages() {
    local missing=() p
    for p in "${SLURM_PKGS[@]}"; do
        if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed'; then
            missing+=("$p")
        fi
    done
    if [[ ${#missing[@]} -eq 0 ]]; then
        return 0
    fi

    log "installing slurm packages: ${missing[*]}"
    # Keep the packages' init scripts from starting daemons with the stock
    # (non-working) config: this script owns the daemons' lifecycle.  Only add
    # a policy-rc.d if there is none (Docker images already ship one).
    local added_policy=0
    if [[ ! -e /usr/sbin/policy-rc.d ]]; then
        printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
        chmod 755 /usr/sbin/policy-rc.d
        added_policy=1
    fi
    local rc=0
    {
        apt-get update -qq &&
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
            "${missing[@]}"
    } >/tmp/rltools-slurm-apt.log 2>&1 || rc=$?
    if [[ "$added_policy" -eq 1 ]]; then
        rm -f /usr/sbin/policy-rc.d
    fi
    if [[ "$rc" -ne 0 ]]; then
        tail -n 30 /tmp/rltools-slurm-apt.log >&2 || true
        die "apt-get failed (exit $rc); full log: /tmp/rltools-slurm-apt.log"
    fi
}

ensure_munge() {
    if [[ ! -s "$MUNGE_KEY" ]]; then
        log "creating munge key $MUNGE_KEY"
        mkdir -p "$(dirname "$MUNGE_KEY")"
        if command -v mungekey >/dev/null; then
            mungekey --create --keyfile="$MUNGE_KEY" --force
        else
            dd if=/dev/urandom of="$MUNGE_KEY" bs=1 count=1024 status=none
        fi
    fi
    # munged refuses keys that are readable by others or not owned by its user.
    chown munge:munge "$MUNGE_KEY"
    chmod 0400 "$MUNGE_KEY"

    if munge_ok; then
        return 0    # already running (ours or the system's): leave it alone
    fi
    log "starting munged"
    # /run/munge is normally made by systemd-tmpfiles, which we cannot rely on.
    mkdir -p /run/munge /var/log/munge /var/lib/munge
    chown munge:munge /run/munge /var/log/munge /var/lib/munge
    chmod 0755 /run/munge
    # Run as the unprivileged munge user like the packaged service; setpriv
    # execs (no extra fork), so the recorded PID is munged itself.  In the
    # foreground (-F) munged logs to stderr only, i.e. $LOG_DIR/munged.stderr.
    launch munged munged setpriv --reuid=munge --regid=munge --init-groups -- /usr/sbin/munged -F
    local i
    for ((i = 0; i < 100; i++)); do
        munge_ok && return 0
        sleep 0.1
    done
    die "munged did not come up within 10 s; see $LOG_DIR/munged.stderr"
}

ensure_hosts() {
    # Node names must resolve to their NodeAddr for srun/slurmd traffic and
    # for `hostname`-style lookups inside jobs.  We append our own marked block
    # (idempotently) rather than editing existing lines: a Debian host may
    # already map 127.0.1.1 to its own hostname, and that line stays intact.
    local block i want
    block="$HOSTS_BEGIN"$'\n'
    for i in 1 2 3 4; do
        block+="127.0.1.$i n$i"$'\n'
    done
    block+="$HOSTS_END"
    if grep -qF "$HOSTS_BEGIN" /etc/hosts; then
        want="$(sed -n "/^$HOSTS_BEGIN\$/,/^$HOSTS_END\$/p" /etc/hosts)"
        [[ "$want" == "$block" ]] && return 0
        # Our block exists but differs: drop it and re-add.  Written in place
        # (not via mv) because /etc/hosts is often a bind mount in containers.
        local tmp
        tmp="$(sed "/^$HOSTS_BEGIN\$/,/^$HOSTS_END\$/d" /etc/hosts)"
        printf '%s\n' "$tmp" >/etc/hosts
    fi
    log "adding n1..n4 to /etc/hosts"
    printf '%s\n' "$block" >>/etc/hosts
}

slurm_conf_text() {
    cat <<EOF
$CONF_MARKER -- rewritten on every 'start'; edit the script, not this file.
# Local 4-node development cluster on loopback (Slurm 22.05).
ClusterName=rltools
# "localhost" is accepted by slurmctld as "this host" whatever the machine's
# hostname is (scontrol show config then reports the real hostname), so the
# same config works on any dev box / CI runner.
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort=6817
# Everything runs as root: simplest inside a container, and slurmd must be
# root anyway to launch jobs as other users.
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# Job credentials normally stay valid ~120 s and a requeued job cannot restart
# on a node until its old credential expires; 10 s makes requeue tests fast.
AuthInfo=cred_expire=10

StateSaveLocation=$CTLD_STATE_DIR
# %n = node name: each of the 4 slurmd processes needs its own spool, PID file
# and log file (multiple-slurmd mode).
SlurmdSpoolDir=$SLURMD_SPOOL_ROOT/%n
# Slurm's own PID files (it SIGTERMs the PID it finds there when starting,
# i.e. replaces a stale daemon of the same role).  Our bookkeeping lives
# separately in $STATE_DIR.
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd-%n.pid
SlurmctldLogFile=$LOG_DIR/slurmctld.log
SlurmdLogFile=$LOG_DIR/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info

# No cgroups: they need a delegated cgroup tree (systemd) that containers and
# CI VMs often lack.  Process tracking via /proc is good enough here.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
# MpiDefault=none: plain srun launches.  (The pmix plugin still logs
# "can not load PMIx library" errors at startup; they are harmless.)
MpiDefault=none
# Debian's default MailProg (/usr/bin/mail) is not installed; avoid the error.
MailProg=/bin/true

# Heterogeneous jobs are only ever started by the backfill scheduler, so run
# backfill every second (default 30 s) and the main scheduler every 2 s.
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1,sched_interval=2
# Allocate cores, not whole nodes, and don't track memory (no --mem needed).
SelectType=select/cons_tres
SelectTypeParameters=CR_Core

# A DOWN node returns to service as soon as its slurmd registers again
# (e.g. after stop/start), instead of waiting for a manual resume.
ReturnToService=2
# Detect dead daemons within ~half a minute rather than the 120 s default.
SlurmctldTimeout=30
SlurmdTimeout=30
# Keep finished jobs visible in squeue --states=all / scontrol show job for
# 5 minutes: there is no accounting DB, so this is the only record.
MinJobAge=300
# Seconds between SIGTERM and SIGKILL on cancel/timeout (default 30).
KillWait=5
# Allow batch jobs to be requeued (scontrol requeue, node failure).
JobRequeue=1
InactiveLimit=0
Waittime=0

# The nodes declare more CPUs than this machine has; config_overrides makes
# slurmd report the configured hardware instead of the detected one, so
# multi-task / multi-CPU jobs fit on a 2-core box.
SlurmdParameters=config_overrides
NodeName=n[1-4] NodeAddr=127.0.1.[1-4] Port=[17001-17004] CPUs=8 RealMemory=8000 State=UNKNOWN
PartitionName=debug Nodes=n[1-4] Default=YES MaxTime=INFINITE State=UP
EOF
}

# write_slurm_conf: sets CONF_CHANGED=1 if the file content changed.
CONF_CHANGED=0
write_slurm_conf() {
    local want
    want="$(slurm_conf_text)"
    mkdir -p "$(dirname "$SLURM_CONF_FILE")"
    if [[ -f "$SLURM_CONF_FILE" ]] && [[ "$(cat "$SLURM_CONF_FILE")" == "$want" ]]; then
        return 0
    fi
    CONF_CHANGED=1
    if [[ -f "$SLURM_CONF_FILE" ]] && ! grep -qF "$CONF_MARKER" "$SLURM_CONF_FILE"; then
        cp -p "$SLURM_CONF_FILE" "$SLURM_CONF_FILE.rltools-backup"
        log "backed up existing $SLURM_CONF_FILE to $SLURM_CONF_FILE.rltools-backup"
    fi
    log "writing $SLURM_CONF_FILE"
    printf '%s\n' "$want" >"$SLURM_CONF_FILE"
    chmod 0644 "$SLURM_CONF_FILE"
}

# Refuse to run next to slurm daemons we did not start: they would fight
# over ports/state, and we must not kill them.
check_foreign_daemons() {
    local ours p foreign=()
    ours=" $(cat "$STATE_DIR"/slurmctld.pid "$STATE_DIR"/slurmd-n*.pid 2>/dev/null | tr '\n' ' ' || true) "
    for p in $(pids_by_comm slurmctld) $(pids_by_comm slurmd); do
        [[ "$ours" == *" $p "* ]] || foreign+=("$p")
    done
    if [[ ${#foreign[@]} -gt 0 ]]; then
        die "slurm daemons not started by this script are running (pids: ${foreign[*]}); stop them first"
    fi
}

start_slurmctld() {
    ctld_pid >/dev/null && return 0
    log "starting slurmctld"
    mkdir -p "$CTLD_STATE_DIR"
    # -D: stay in the foreground so launch() records the real PID.
    launch slurmctld slurmctld /usr/sbin/slurmctld -D
}

wait_for_ctld() {
    local deadline=$1
    until ctld_responding; do
        if ! ctld_pid >/dev/null; then
            echo "local-slurm: ERROR: slurmctld exited during startup" >&2
            tail -n 20 "$LOG_DIR/slurmctld.log" "$LOG_DIR/slurmctld.stderr" 2>/dev/null >&2 || true
            log_pointers
            exit 1
        fi
        if ((SECONDS >= deadline)); then
            echo "local-slurm: ERROR: slurmctld did not answer 'scontrol ping' within ${TIMEOUT} s" >&2
            log_pointers
            exit 1
        fi
        sleep 0.5
    done
}

start_slurmds() {
    local n
    for n in "${NODES[@]}"; do
        slurmd_pid "$n" >/dev/null && continue
        log "starting slurmd -N $n"
        mkdir -p "$SLURMD_SPOOL_ROOT/$n"
        launch "slurmd-$n" slurmd /usr/sbin/slurmd -D -N "$n"
    done
}

wait_for_nodes() {
    local deadline=$1 last_resume=0 states n bad
    log "waiting for ${#NODES[@]} nodes to be idle (timeout ${TIMEOUT} s)"
    until nodes_healthy; do
        states="$(node_states || true)"
        for n in "${NODES[@]}"; do
            if ! slurmd_pid "$n" >/dev/null; then
                echo "local-slurm: ERROR: slurmd for $n exited; see $LOG_DIR/slurmd-$n.log and $LOG_DIR/slurmd-$n.stderr" >&2
                tail -n 15 "$LOG_DIR/slurmd-$n.log" "$LOG_DIR/slurmd-$n.stderr" 2>/dev/null >&2 || true
                exit 1
            fi
        done
        # Nodes remembered as DOWN/DRAINED in the saved state (e.g. after an
        # unclean stop) need an explicit resume once their slurmd is back.
        bad="$(awk '$2 ~ /^(down|drain|fail)/ && $2 !~ /\*$/ {print $1}' <<<"$states" | paste -sd, -)"
        if [[ -n "$bad" ]] && ((SECONDS - last_resume >= 3)); then
            log "resuming nodes $bad"
            scontrol update nodename="$bad" state=resume 2>/dev/null || true
            last_resume=$SECONDS
        fi
        if ((SECONDS >= deadline)); then
            echo "local-slurm: ERROR: nodes not all idle after ${TIMEOUT} s; current states:" >&2
            # shellcheck disable=SC2001
            sed 's/^/    /' <<<"$states" >&2
            scontrol show node "$NODE_RANGE" 2>/dev/null | grep -E 'NodeName=|State=|Reason=' >&2 || true
            log_pointers
            exit 1
        fi
        sleep 0.5
    done
}

# Stop only the slurm daemons we started (munge is left running).
stop_slurm_daemons() {
    local n pid todo=()
    for n in "${NODES[@]}"; do
        if pid="$(slurmd_pid "$n")"; then todo+=("slurmd-$n=$pid"); fi
    done
    if pid="$(ctld_pid)"; then todo+=("slurmctld=$pid"); fi
    if [[ ${#todo[@]} -gt 0 ]]; then
        stop_pids "${todo[@]}"
    fi
}

cmd_start() {
    local t0=$SECONDS
    # Cheap idempotency check first: no apt, no rewrites if everything is up
    # with the current config.
    if command -v sinfo >/dev/null && [[ -f "$SLURM_CONF_FILE" ]] &&
        [[ "$(cat "$SLURM_CONF_FILE")" == "$(slurm_conf_text)" ]] &&
        all_daemons_tracked && munge_ok && ctld_responding && nodes_healthy; then
        log "cluster already up (slurmctld + ${#NODES[@]} nodes healthy); nothing to do"
        sinfo
        return 0
    fi

    install_packages
    ensure_munge
    ensure_hosts
    mkdir -p "$STATE_DIR" "$LOG_DIR" "$CTLD_STATE_DIR" "$SLURMD_SPOOL_ROOT"

    write_slurm_conf
    if [[ "$CONF_CHANGED" -eq 1 ]] && any_slurm_daemon_tracked; then
        # Node/partition definitions only take effect on a restart.
        log "slurm.conf changed while daemons were running; restarting them"
        stop_slurm_daemons
    fi

    check_foreign_daemons
    local deadline=$((SECONDS + TIMEOUT))
    start_slurmctld
    wait_for_ctld "$deadline"
    start_slurmds
    wait_for_nodes "$deadline"
    log "cluster up in $((SECONDS - t0)) s"
    sinfo
}

# ---------------------------------------------------------------------------
# stop / status
# ---------------------------------------------------------------------------

cmd_stop() {
    local pid any=0
    if ctld_pid >/dev/null && ctld_responding; then
        # Cancel jobs first: their slurmstepd processes would otherwise outlive
        # slurmd and leak (we did not start them, so we don't kill them).
        local jobs
        jobs="$(squeue -h -o '%A' 2>/dev/null | sort -u | paste -sd' ' - || true)"
        if [[ -n "$jobs" ]]; then
            log "cancelling jobs: $jobs"
            # shellcheck disable=SC2086
            scancel $jobs 2>/dev/null || true
            local i
            for ((i = 0; i < 40; i++)); do
                [[ -z "$(squeue -h -t running,completing -o '%A' 2>/dev/null)" ]] && break
                sleep 0.5
            done
        fi
    fi
    if any_slurm_daemon_tracked; then
        any=1
    fi
    stop_slurm_daemons
    if pid="$(munged_pid)"; then
        any=1
        stop_pids "munged=$pid"
    fi
    if [[ "$any" -eq 0 ]]; then
        log "no daemons started by this script are running"
    else
        log "stopped"
    fi
}

cmd_status() {
    local rc=0 pid n
    if ! command -v sinfo >/dev/null; then
        echo "slurm is not installed (run: $0 start)"
        return 1
    fi
    if munge_ok; then
        if pid="$(munged_pid)"; then echo "munged:    up (pid $pid, started by this script)"
        else echo "munged:    up (not started by this script)"; fi
    else
        echo "munged:    DOWN"; rc=1
    fi
    if pid="$(ctld_pid)"; then
        if ctld_responding; then echo "slurmctld: up (pid $pid)"
        else echo "slurmctld: running (pid $pid) but not answering scontrol ping"; rc=1; fi
    else
        echo "slurmctld: DOWN"; rc=1
    fi
    for n in "${NODES[@]}"; do
        if pid="$(slurmd_pid "$n")"; then echo "slurmd $n: up (pid $pid)"
        else echo "slurmd $n: DOWN"; rc=1; fi
    done
    if ctld_responding; then
        sinfo || rc=1
        nodes_healthy || { echo "nodes are not all idle/in use:"; node_states | sed 's/^/    /'; rc=1; }
    fi
    if [[ "$rc" -eq 0 ]]; then echo "healthy"; else echo "NOT healthy"; fi
    return "$rc"
}

main() {
    [[ $# -eq 1 ]] || usage
    case "$1" in
        start)  require_root start;  cmd_start ;;
        stop)   require_root stop;   cmd_stop ;;
        status) require_root status; cmd_status ;;
        *) usage ;;
    esac
}

main "$@"
