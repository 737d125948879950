#!/usr/bin/env bash
# A real multi-node Slurm cluster on this one machine, for orchestrate's tests.
#
#   tests/clusters/slurm.sh up       install slurm-wlm + munge if missing, start the cluster
#   tests/clusters/slurm.sh down     stop every daemon and job process it started, undo /etc/hosts
#   tests/clusters/slurm.sh status   print sinfo; exit 0 when up, 3 when not
#   tests/clusters/slurm.sh kill-node nK    a power cut: SIGKILL every process of node nK
#   tests/clusters/slurm.sh start-node nK   start nK's slurmd again; wait until it is not down
#
# Why it looks like this (measured facts: docs/testing-clusters.md):
# - Each node is one `slurmd -N nK` with its own port, spool and log, and its own network
#   namespace (own IPv4 address on a private bridge) and UTS namespace (hostname nK). A job that
#   uses the wrong MASTER_ADDR then fails as it would on real machines, instead of reaching
#   rank 0 through a shared loopback. ORCHESTRATE_SLURM_LAYOUT=loopback runs every node in the
#   root network namespace with a distinct 127.0.1.K address instead (no bridge, no veths).
# - Both namespaces of a node are pinned by files, so `down` can find and kill every process
#   the node ever started (slurmstepd survives its slurmd) by namespace, never by name.
# - munge, slurmctld and slurmd run in the foreground (-F/-D) in their own sessions, so their
#   PIDs are known at once and they never hold the caller's stdout open.
# - No accounting: sacct does not work here on purpose; `scontrol show job` keeps finished jobs
#   for MinJobAge seconds and jobcomp/filetxt writes one line per finished job.
#
# Environment: ORCHESTRATE_SLURM_DIR (state dir, default /tmp/orchestrate-slurm),
# ORCHESTRATE_SLURM_NODE_COUNT (default 3), ORCHESTRATE_SLURM_LAYOUT (netns|loopback),
# ORCHESTRATE_SLURM_SUBNET (first three octets of the /24, default 198.18.7: in 198.18.0.0/15,
# the range RFC 2544 reserves for benchmarking, so it never shadows an office or VPN network),
# ORCHESTRATE_SLURM_PORT (slurmctld port; slurmd K listens on PORT+K, default 16817),
# ORCHESTRATE_SLURM_TIMEOUT (seconds to wait for readiness, default 60).
# `up` records the settings it used in $DIR/settings; `down` and `status` follow that record,
# so they clean up exactly what was started whatever the caller's environment says now.
set -euo pipefail

# ORCHESTRATE_SLURM_RELEASE: `host` (default) runs this machine's Slurm (Debian 12: 22.05);
# `2411` runs Debian 13's Slurm 24.11 from the root that tests/clusters/slurm-root.sh builds
# (ORCHESTRATE_SLURM_ROOT), as a second cluster beside the first: its own state dir, subnet,
# ports, munge, bridge, namespaces and node names (m1..), so both can run at once.
RELEASE=${ORCHESTRATE_SLURM_RELEASE:-host}
ROOT=${ORCHESTRATE_SLURM_ROOT:-/var/cache/orchestrate/slurm-trixie}
case $RELEASE in
host) defaults=(/tmp/orchestrate-slurm 198.18.7 16817 "" n 1) ;;
2411) defaults=(/tmp/orchestrate-slurm2411 198.18.6 16927 2 m 2) ;;
*) echo "slurm.sh: error: ORCHESTRATE_SLURM_RELEASE: want host or 2411 (got $RELEASE)" >&2; exit 1 ;;
esac
DIR=${ORCHESTRATE_SLURM_DIR:-${defaults[0]}}
NNODES=${ORCHESTRATE_SLURM_NODE_COUNT:-3}
LAYOUT=${ORCHESTRATE_SLURM_LAYOUT:-netns}
SUBNET=${ORCHESTRATE_SLURM_SUBNET:-${defaults[1]}}
PORT=${ORCHESTRATE_SLURM_PORT:-${defaults[2]}}
TIMEOUT=${ORCHESTRATE_SLURM_TIMEOUT:-60}
TAG=${defaults[3]}         # in the machine-wide names: bridge, namespaces, veths, hosts lines
NODE_PREFIX=${defaults[4]} # node names: n1.. (host release), m1.. (24.11)
LOOP_OCTET=${defaults[5]}  # loopback layout: nodes at 127.0.<this>.K
CPUS_PER_NODE=4
MEM_PER_NODE=4000
MARK="# orchestrate-slurm${TAG:+$RELEASE}-test-cluster"
BRIDGE=orslurm${TAG:-0}
CTLD_ADDR="$SUBNET.254"
NETNS_PREFIX=orslurm$TAG-
VETH_PREFIX=osl$TAG-
PACKAGES=(slurmctld slurmd slurm-client slurm-wlm munge iproute2)

export SLURM_CONF="$DIR/slurm.conf"

die() {
    echo "slurm.sh: error: $*" >&2
    exit 1
}

say() {
    echo "slurm.sh: $*"
}

use_recorded_settings() {
    [[ -f $DIR/settings ]] || return 0
    local key value
    while IFS='=' read -r key value; do
        case $key in
        NNODES) NNODES=$value ;;
        LAYOUT) LAYOUT=$value ;;
        SUBNET) SUBNET=$value ;;
        PORT) PORT=$value ;;
        ROOT) ROOT=$value ;;
        esac
    done <"$DIR/settings"
    CTLD_ADDR="$SUBNET.254"
    root_mode
}

record_settings() {
    printf '%s\n' "NNODES=$NNODES" "LAYOUT=$LAYOUT" "SUBNET=$SUBNET" "PORT=$PORT" "ROOT=$ROOT" \
        >"$DIR/settings"
}

node_names() {
    local k
    for ((k = 1; k <= NNODES; k++)); do echo "$NODE_PREFIX$k"; done
}

node_addr() { # n3 -> the address other nodes reach it at
    local k=${1#"$NODE_PREFIX"}
    if [[ $LAYOUT == netns ]]; then echo "$SUBNET.$k"; else echo "127.0.$LOOP_OCTET.$k"; fi
}

check_settings() {
    [[ $(id -u) == 0 ]] || die "must run as root (it starts slurmd, edits /etc/hosts)"
    [[ $NNODES =~ ^[1-9]$ ]] || die "ORCHESTRATE_SLURM_NODE_COUNT: want 1..9 (got $NNODES)"
    [[ $LAYOUT == netns || $LAYOUT == loopback ]] ||
        die "ORCHESTRATE_SLURM_LAYOUT: want netns or loopback (got $LAYOUT)"
    [[ $SUBNET =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]] ||
        die "ORCHESTRATE_SLURM_SUBNET: want three octets like 198.18.7 (got $SUBNET)"
    [[ $DIR == /* && $DIR != / && $DIR != *[[:space:]]* ]] ||
        die "ORCHESTRATE_SLURM_DIR: want an absolute path without spaces (got $DIR)"
}

# ---------------------------------------------------------------- packages

missing_packages() {
    local p
    for p in "${PACKAGES[@]}"; do
        dpkg-query -W -f='${Status}\n' "$p" 2>/dev/null | grep -q '^install ok installed$' ||
            echo "$p"
    done
}

install_packages() {
    if [[ $RELEASE != host ]]; then # the root holds this release's Slurm and munge
        [[ -e $ROOT/.orchestrate-slurm-root ]] ||
            die "no Slurm root at $ROOT: build it with tests/clusters/slurm-root.sh root"
        command -v ip >/dev/null || die "iproute2 is missing"
        return 0
    fi
    local missing
    missing=$(missing_packages)
    [[ -z $missing ]] && return 0
    say "installing $(echo "$missing" | tr '\n' ' ')"
    # Without a policy-rc.d, the packages' postinst scripts would start the system-wide munged
    # and slurm daemons through /etc/init.d; ours must be the only ones running.
    local policy=/usr/sbin/policy-rc.d added_policy=0
    if [[ ! -e $policy ]]; then
        printf '#!/bin/sh\nexit 101\n' >"$policy"
        chmod 755 "$policy"
        added_policy=1
    fi
    local rc=0
    {
        export DEBIAN_FRONTEND=noninteractive
        apt-get -o DPkg::Lock::Timeout=120 update -qq &&
            apt-get -o DPkg::Lock::Timeout=120 install -y -qq --no-install-recommends \
                "${PACKAGES[@]}" >/dev/null
    } || rc=$?
    ((added_policy)) && rm -f "$policy"
    ((rc == 0)) || die "apt-get could not install ${PACKAGES[*]} (exit $rc)"
}

# ---------------------------------------------------------------- /etc/hosts

# /etc/hosts edits hold a flock on /etc/hosts itself, so that other test-cluster scripts that
# do the same (sshhosts.sh) never interleave a read-modify-write with ours.
hosts_remove() {
    [[ -f /etc/hosts ]] || return 0
    # shellcheck disable=SC2094 # $(grep) has read the whole file before printf rewrites it
    (
        flock 9
        grep -qF "$MARK" /etc/hosts || exit 0
        local kept
        kept=$(grep -vF "$MARK" /etc/hosts || true)
        # Rewrite in place: /etc/hosts is often a bind mount that cannot be replaced by rename.
        printf '%s\n' "$kept" >/etc/hosts
    ) 9</etc/hosts
}

hosts_add() {
    hosts_remove
    local n addr lines=""
    for n in $(node_names); do
        addr=$(node_addr "$n")
        # torch's TCPStore reverse-resolves peers as IPv4-mapped IPv6; glibc matches those only
        # against ::ffff: lines, else it falls through to (slow, unreachable) DNS.
        lines+="$addr $n $MARK"$'\n'"::ffff:$addr $n $MARK"$'\n'
    done
    (
        flock 9
        printf '%s' "$lines" >>/etc/hosts
    ) 9</etc/hosts
}

# ---------------------------------------------------------------- network namespaces

netns_up() {
    [[ $LAYOUT == netns ]] || return 0
    if ip route show | grep -v "dev $BRIDGE" | grep -v '^unreachable' | grep -q "^$SUBNET\."; then
        die "the subnet $SUBNET.0/24 is already routed here; set ORCHESTRATE_SLURM_SUBNET"
    fi
    ip link add "$BRIDGE" type bridge
    ip addr add "$CTLD_ADDR/24" dev "$BRIDGE"
    ip link set "$BRIDGE" up
    # Should the bridge vanish, traffic for the test subnet is dropped, never routed out.
    ip route add unreachable "$SUBNET.0/24" metric 4000
    local n ns
    for n in $(node_names); do
        ns="$NETNS_PREFIX$n"
        ip netns add "$ns"
        ip link add "$VETH_PREFIX$n" type veth peer name eth0 netns "$ns"
        ip link set "$VETH_PREFIX$n" master "$BRIDGE" up
        ip -n "$ns" addr add "$(node_addr "$n")/24" dev eth0
        ip -n "$ns" link set lo up
        ip -n "$ns" link set eth0 up
    done
}

netns_down() {
    local n
    for n in $(node_names); do
        ip link del "$VETH_PREFIX$n" 2>/dev/null || true
        ip netns del "$NETNS_PREFIX$n" 2>/dev/null || true
    done
    ip link del "$BRIDGE" 2>/dev/null || true
    ip route del unreachable "$SUBNET.0/24" metric 4000 2>/dev/null || true
}

uts_file() { echo "$DIR/ns/$1.uts"; }

uts_up() { # a pinned UTS namespace per node: its hostname, and the marker `down` kills by
    local n f
    mkdir -p "$DIR/ns"
    for n in $(node_names); do
        f=$(uts_file "$n")
        touch "$f"
        unshare --uts="$f" true
        if [[ $LAYOUT == netns ]]; then nsenter --uts="$f" hostname "$n"; fi
    done
}

uts_down() {
    local n f
    for n in $(node_names); do
        f=$(uts_file "$n")
        [[ -e $f ]] || continue
        umount "$f" 2>/dev/null || true
        rm -f "$f"
    done
}

ns_inode() { # the inode of a pinned namespace file, or nothing when it is not pinned
    findmnt -n -o FSTYPE --mountpoint "$1" 2>/dev/null | grep -q nsfs || return 0
    stat -L -c %i "$1"
}

pids_in_uts() { # every process whose UTS namespace is one of the pinned ones (inodes as args)
    (($#)) || return 0
    # One stat for all of /proc (a readlink per process takes seconds on a busy machine).
    stat -L -c '%i %n' /proc/[0-9]*/ns/uts 2>/dev/null |
        awk -v want=" $* " 'index(want, " " $1 " ") { split($2, p, "/"); print p[3] }'
    return 0
}

node_prefix() { # the command prefix that runs a program inside node $1's namespaces
    local n=$1
    printf '%s\n' nsenter "--uts=$(uts_file "$n")"
    [[ $LAYOUT == netns ]] && printf '%s\n' "--net=/run/netns/$NETNS_PREFIX$n"
    return 0
}

# ---------------------------------------------------------------- a release from its own root

# With ORCHESTRATE_SLURM_RELEASE=2411 every Slurm and munge program runs chrooted into the root,
# inside a mount namespace of the cluster's own (pinned at $DIR/ns/mnt) where the machine's
# /tmp, /root, /home, /work, /usr/local, the checkout and /proc /dev /sys are bound at their
# own paths: the jobs' Python, the repository and the tests' directories are where the tests
# put them, while the machine's own mount table gains nothing. The clients (sbatch, scontrol,
# srun, ...) are wrappers in $DIR/bin that enter the same; inside a job (already in the root)
# they run the root's program directly.
IN_ROOT=()
root_mode() {
    IN_ROOT=()
    [[ $RELEASE == host ]] && return 0
    IN_ROOT=(nsenter "--mount=$DIR/ns/mnt" chroot "$ROOT")
    PATH="$DIR/bin:$PATH"
}
root_mode

CLIENTS=(sbatch srun salloc scontrol squeue scancel sinfo sacct sstat sprio sshare sattach)

bound_paths() {
    local p repo
    repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
    for p in /root /home /tmp /var/tmp /work /usr/local "$repo"; do
        [[ -d $p ]] && echo "$p"
    done
    return 0
}

write_wrapper() { # the client $1 of the root's release, entered from this machine
    local name=$1 paths
    paths=$(bound_paths | sed 's|$|*|' | paste -sd '|')
    cat >"$DIR/bin/$name" <<EOF
#!/bin/bash
# Slurm $RELEASE's $name from $ROOT (written by tests/clusters/slurm.sh)
[[ -e /.orchestrate-slurm-root ]] && exec /usr/bin/$name "\$@" # in a job: in the root already
dir=\$PWD
case \$dir in $paths) ;; *) dir=/ ;; esac
exec nsenter --mount=$DIR/ns/mnt chroot $ROOT /usr/bin/env -C "\$dir" /usr/bin/$name "\$@"
EOF
    chmod 755 "$DIR/bin/$name"
}

mount_ns_up() {
    [[ $RELEASE == host ]] && return 0
    mkdir -p "$DIR/ns" "$DIR/bin"
    if ! findmnt -n --mountpoint "$DIR/ns" >/dev/null; then
        mount --bind "$DIR/ns" "$DIR/ns" # a pinned mount namespace needs a private mount
        mount --make-private "$DIR/ns"
    fi
    touch "$DIR/ns/mnt"
    unshare --mount="$DIR/ns/mnt" --propagation slave true
    local p script="set -e"
    for p in $(bound_paths) /proc /dev /sys; do
        script+="; mkdir -p '$ROOT$p'; mount --rbind '$p' '$ROOT$p'"
    done
    for p in /etc/hosts /etc/passwd /etc/group; do # a fresh minbase root has no /etc/hosts
        script+="; [ -e '$ROOT$p' ] || : >'$ROOT$p'; mount --bind '$p' '$ROOT$p'"
    done
    nsenter --mount="$DIR/ns/mnt" bash -c "$script"
    for p in "${CLIENTS[@]}"; do write_wrapper "$p"; done
}

mount_ns_down() {
    [[ -e $DIR/ns/mnt ]] || return 0
    umount "$DIR/ns/mnt" 2>/dev/null || true
    rm -f "$DIR/ns/mnt"
    umount "$DIR/ns" 2>/dev/null || true
}

# ---------------------------------------------------------------- config

write_munge_key() {
    mkdir -p "$DIR/munge"
    chmod 755 "$DIR" "$DIR/munge" # munged: "execute permissions for all required"
    if [[ $RELEASE == host ]]; then
        mungekey -c -k "$DIR/munge/munge.key"
    else
        dd if=/dev/urandom of="$DIR/munge/munge.key" bs=1024 count=1 status=none
    fi
    chmod 600 "$DIR/munge/munge.key"
}

write_slurm_conf() {
    local host first_job_id n k
    host=$(hostname -s)
    # Job ids restart on a fresh cluster; a new first id per bring-up keeps output files of
    # earlier clusters from being mistaken for this one's (range stays below MaxJobId).
    # The two releases' clusters take disjoint halves of the ids (below Slurm's MaxJobId limit,
    # 67043328): tests find a job's processes machine-wide by SLURM_JOB_ID, and two clusters
    # brought up in the same second would otherwise number their jobs alike.
    local base=1000
    [[ $RELEASE == host ]] || base=34000000
    first_job_id=$((($(date +%s) % 3000000) * 10 + base))
    local ctld_addr=127.0.0.1
    [[ $LAYOUT == netns ]] && ctld_addr=$CTLD_ADDR
    {
        cat <<EOF
# Written by tests/clusters/slurm.sh; rewritten on every bring-up.
ClusterName=orchestrate
SlurmctldHost=$host($ctld_addr)
SlurmctldPort=$PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$DIR/munge/munge.socket,cred_expire=10
StateSaveLocation=$DIR/ctld
SlurmctldPidFile=$DIR/pids/slurmctld.pidfile
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdSpoolDir=$DIR/spool/%n
SlurmdPidFile=$DIR/pids/slurmd-%n.pidfile
SlurmdLogFile=$DIR/log/slurmd-%n.log
SlurmdParameters=config_overrides
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1,sched_interval=2
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/filetxt
JobCompLoc=$DIR/log/jobcomp.txt
MpiDefault=none
SwitchType=switch/none
MailProg=/bin/true
ReturnToService=2
SlurmdTimeout=30
InactiveLimit=0
KillWait=5
MinJobAge=3600
FirstJobId=$first_job_id
EOF
        for n in $(node_names); do
            k=${n#"$NODE_PREFIX"}
            local nodehost=$host
            [[ $LAYOUT == netns ]] && nodehost=$n
            echo "NodeName=$n NodeHostname=$nodehost NodeAddr=$(node_addr "$n")" \
                "Port=$((PORT + k)) CPUs=$CPUS_PER_NODE RealMemory=$MEM_PER_NODE State=UNKNOWN"
        done
        echo "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP"
    } >"$SLURM_CONF"
}

write_env_sh() {
    cat >"$DIR/env.sh" <<EOF
# Source me: points Slurm's clients at the orchestrate test cluster.
export SLURM_CONF=$SLURM_CONF
export ORCHESTRATE_SLURM_DIR=$DIR
export ORCHESTRATE_SLURM_NODES="$(node_names | tr '\n' ' ' | sed 's/ $//')"
EOF
    if [[ $RELEASE != host ]]; then # the clients to put first on PATH
        echo "export ORCHESTRATE_SLURM_BIN=$DIR/bin" >>"$DIR/env.sh"
    fi
}

# ---------------------------------------------------------------- daemons

start_daemon() { # name, then the command; records the PID, output goes to its log
    local name=$1
    shift
    # From /, not the caller's directory: a daemon outlives the checkout or temporary directory
    # that started it, and slurmstepd (forked from slurmd) would print "Unable to get current
    # working directory" into every rank's output once that directory is gone.
    # Without the caller's other descriptors: a daemon (munged keeps them) must not hold the
    # `flock /tmp/slurm-tests.lock` its starter ran under for as long as the cluster runs.
    (
        cd /
        for fd in /proc/"$BASHPID"/fd/*; do
            fd=${fd##*/}
            if ((fd > 2)); then eval "exec $fd>&-"; fi
        done
        exec setsid "$@" </dev/null >>"$DIR/log/$name.out" 2>&1
    ) &
    echo $! >"$DIR/pids/$name.pid"
}

pid_of() {
    local f="$DIR/pids/$1.pid"
    [[ -f $f ]] && cat "$f"
    return 0
}

alive() { # a zombie counts as gone: PID 1 here may take a second or more to reap it
    [[ -n $1 ]] && kill -0 "$1" 2>/dev/null || return 1
    local stat
    read -r stat 2>/dev/null <"/proc/$1/stat" || return 1
    stat=${stat##*) } # the state letter follows the command name in parentheses
    [[ ${stat:0:1} != Z ]]
}

log_tails() {
    local f
    for f in "$DIR"/log/*.log "$DIR"/log/*.out; do
        [[ -s $f ]] || continue
        [[ $f == *.out && -s ${f%.out}.log ]] && continue # the same lines as the .log
        echo "---- tail of $f" >&2
        tail -n 15 "$f" >&2
    done
}

fail_up() {
    trap - ERR
    echo "slurm.sh: error: $*" >&2
    log_tails
    echo "slurm.sh: tearing the half-started cluster down" >&2
    do_down >/dev/null 2>&1 || true
    exit 1
}

wait_for() { # description, then a command that succeeds once ready
    local what=$1
    shift
    local deadline=$((SECONDS + TIMEOUT))
    while true; do
        check_daemons_alive
        "$@" >/dev/null 2>&1 && return 0
        ((SECONDS < deadline)) || fail_up "$what not ready after ${TIMEOUT}s"
        sleep 0.1
    done
}

check_daemons_alive() {
    local f name
    for f in "$DIR"/pids/*.pid; do
        [[ -e $f ]] || continue
        name=$(basename "$f" .pid)
        alive "$(cat "$f")" || fail_up "$name exited during bring-up"
    done
}

ctld_up() { timeout 2 scontrol ping | grep -q 'is UP'; }

all_idle() {
    [[ $(sinfo -h -N -t idle -o %N | sort -u | wc -l) == "$NNODES" ]]
}

is_up() {
    [[ -f $SLURM_CONF ]] || return 1
    local name
    for name in munged slurmctld $(node_names | sed 's/^/slurmd-/'); do
        alive "$(pid_of "$name")" || return 1
    done
    ctld_up 2>/dev/null
}

any_recorded_alive() {
    local f
    for f in "$DIR"/pids/*.pid; do
        [[ -e $f ]] || continue
        alive "$(cat "$f")" && return 0
    done
    return 1
}

prepare_dir() {
    if [[ -e $DIR && ! -e $DIR/.orchestrate-slurm ]] && [[ -n $(ls -A "$DIR") ]]; then
        die "$DIR exists, is not empty and was not made by this script; set ORCHESTRATE_SLURM_DIR"
    fi
    rm -rf "${DIR:?}/ctld" "$DIR/spool" "$DIR/pids" "$DIR/log" "$DIR/munge" "$DIR/env.sh"
    mkdir -p "$DIR/ctld" "$DIR/pids" "$DIR/log"
    touch "$DIR/.orchestrate-slurm"
    local n
    for n in $(node_names); do mkdir -p "$DIR/spool/$n"; done
}

check_no_other_cluster() { # names are machine-wide: one cluster per machine
    local what=""
    if ip link show "$BRIDGE" >/dev/null 2>&1; then what="bridge $BRIDGE"; fi
    if ip netns list 2>/dev/null | grep -q "^$NETNS_PREFIX"; then what+=" netns $NETNS_PREFIX*"; fi
    if grep -qF "$MARK" /etc/hosts 2>/dev/null; then what+=" /etc/hosts lines"; fi
    [[ -z $what ]] && return 0
    die "another Slurm test cluster (or its leftovers) exists:$what;" \
        "run \`ORCHESTRATE_SLURM_DIR=<its dir> $0 down\` first"
}

do_up() {
    check_settings
    local requested=("$NNODES" "$LAYOUT" "$SUBNET" "$PORT")
    use_recorded_settings
    if is_up; then
        say "already up ($NNODES nodes, $LAYOUT layout, subnet $SUBNET, SLURM_CONF=$SLURM_CONF)"
        local running=("$NNODES" "$LAYOUT" "$SUBNET" "$PORT")
        if [[ "${running[*]}" != "${requested[*]}" ]]; then
            # Say so: a cluster from before a settings change (an old default subnet) would
            # otherwise pass for the one asked for.
            echo "slurm.sh: warning: the running cluster has nodes/layout/subnet/port" \
                "${running[*]}, not the requested ${requested[*]}; \`$0 down\` to change" >&2
        fi
        return 0
    fi
    if [[ -f $DIR/settings ]]; then
        # A cluster that died or was half started: clear its namespaces, hosts lines and
        # stray processes before starting anew.
        if any_recorded_alive; then say "found a half-running cluster in $DIR: taking it down"; fi
        do_down >/dev/null
    fi
    NNODES=${requested[0]} LAYOUT=${requested[1]} SUBNET=${requested[2]} PORT=${requested[3]}
    CTLD_ADDR="$SUBNET.254"
    install_packages
    check_no_other_cluster
    local t0=$EPOCHREALTIME
    prepare_dir
    record_settings
    # From here on, any failing command tears down what was started so far.
    set -E
    trap 'fail_up "line $LINENO: $BASH_COMMAND: failed"' ERR
    write_munge_key
    write_slurm_conf
    hosts_add
    netns_up
    mount_ns_up
    uts_up

    start_daemon munged "${IN_ROOT[@]}" /usr/sbin/munged -F --force \
        --socket="$DIR/munge/munge.socket" --key-file="$DIR/munge/munge.key" \
        --pid-file="$DIR/munge/munged.pid" --seed-file="$DIR/munge/munged.seed"
    wait_for "munged" test -S "$DIR/munge/munge.socket"

    start_daemon slurmctld "${IN_ROOT[@]}" /usr/sbin/slurmctld -D -f "$SLURM_CONF"
    wait_for "slurmctld (scontrol ping)" ctld_up

    local n prefix
    for n in $(node_names); do
        mapfile -t prefix < <(node_prefix "$n")
        start_daemon "slurmd-$n" "${prefix[@]}" "${IN_ROOT[@]}" /usr/sbin/slurmd -D -N "$n" -f "$SLURM_CONF"
    done
    wait_for "all $NNODES nodes idle (sinfo)" all_idle

    write_env_sh
    trap - ERR
    local elapsed
    elapsed=$(awk -v a="$t0" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.2f", b - a }')
    say "up in ${elapsed}s: $LAYOUT layout, nodes $(node_names | tr '\n' ' ')"
    say "source $DIR/env.sh   # exports SLURM_CONF=$SLURM_CONF"
}

# ---------------------------------------------------------------- teardown

stop_pids() { # SIGTERM, then SIGKILL whatever is left after a grace period
    local grace_us=3000000 pids=() left=() p
    for p in "$@"; do
        if alive "$p"; then pids+=("$p"); fi
    done
    ((${#pids[@]})) || return 0
    kill -TERM "${pids[@]}" 2>/dev/null || true
    local deadline=$((${EPOCHREALTIME/./} + grace_us))
    while ((${EPOCHREALTIME/./} < deadline)); do
        left=()
        for p in "${pids[@]}"; do
            if alive "$p"; then left+=("$p"); fi
        done
        ((${#left[@]})) || return 0
        sleep 0.05
    done
    # slurmstepd ignores SIGTERM; its tasks have had theirs.
    kill -KILL "${left[@]}" 2>/dev/null || true
    sleep 0.1
}

node_pids() { # every process left in any node's UTS namespace: slurmstepd and job tasks
    local n inode inodes=()
    for n in $(node_names); do
        inode=$(ns_inode "$(uts_file "$n")")
        [[ -n $inode ]] && inodes+=("$inode")
    done
    pids_in_uts "${inodes[@]}"
}

do_down() {
    check_settings
    use_recorded_settings
    local t0=$EPOCHREALTIME n pids=()
    for n in $(node_names); do pids+=("$(pid_of "slurmd-$n")"); done
    # slurmstepd and its tasks outlive a stopped slurmd; they all live in the node's namespace.
    mapfile -t -O "${#pids[@]}" pids < <(node_pids)
    pids+=("$(pid_of slurmctld)" "$(pid_of munged)")
    # All at once, in parallel: nothing here needs an orderly shutdown (every bring-up starts
    # from empty state).
    stop_pids "${pids[@]}"
    mapfile -t pids < <(node_pids) # anything forked while the first round was stopping
    stop_pids "${pids[@]}"
    rm -f "$DIR"/pids/*.pid "$DIR/env.sh"
    uts_down
    mount_ns_down
    netns_down
    hosts_remove
    local elapsed
    elapsed=$(awk -v a="$t0" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.2f", b - a }')
    say "down in ${elapsed}s (logs kept in $DIR/log)"
}

node_arg() { # the node named by the verb's argument, checked against this cluster
    local n=${1:-} k
    for k in $(node_names); do
        if [[ $k == "$n" ]]; then
            echo "$n"
            return 0
        fi
    done
    die "no node '$n' in this cluster (nodes: $(node_names | tr '\n' ' '))"
}

do_kill_node() { # a node failure: its slurmd, slurmstepds and job tasks die at once
    check_settings
    use_recorded_settings
    is_up || die "the cluster is not up"
    local n inode pids=() p
    n=$(node_arg "${1:-}")
    inode=$(ns_inode "$(uts_file "$n")")
    [[ -n $inode ]] || die "node $n has no pinned UTS namespace"
    mapfile -t pids < <(pids_in_uts "$inode")
    if ((${#pids[@]})); then kill -KILL "${pids[@]}" 2>/dev/null || true; fi
    for p in "${pids[@]}"; do # wait until they are gone (a zombie counts as gone)
        while alive "$p"; do sleep 0.05; done
    done
    say "killed node $n (${#pids[@]} processes)"
}

do_start_node() { # the node comes back: slurmd again, and ReturnToService=2 makes it usable
    check_settings
    use_recorded_settings
    local n prefix deadline state
    n=$(node_arg "${1:-}")
    if ! alive "$(pid_of "slurmd-$n")"; then
        mapfile -t prefix < <(node_prefix "$n")
        start_daemon "slurmd-$n" "${prefix[@]}" "${IN_ROOT[@]}" /usr/sbin/slurmd -D -N "$n" -f "$SLURM_CONF"
    fi
    deadline=$((SECONDS + TIMEOUT))
    while true; do
        state=$(sinfo -h -N -n "$n" -o %T 2>/dev/null || true)
        [[ -n $state && $state != *down* && $state != *'*' ]] && break
        ((SECONDS < deadline)) || die "node $n still '$state' after ${TIMEOUT}s"
        sleep 0.2
    done
    say "node $n is back ($state)"
}

do_status() {
    check_settings
    use_recorded_settings
    if is_up; then
        sinfo -N -l
        return 0
    fi
    say "not running (no live cluster recorded in $DIR)"
    return 3
}

case ${1:-} in
up) do_up ;;
down) do_down ;;
status) do_status ;;
kill-node) do_kill_node "${2:-}" ;;
start-node) do_start_node "${2:-}" ;;
*)
    echo "usage: $0 up|down|status|kill-node NODE|start-node NODE" >&2
    exit 2
    ;;
esac
