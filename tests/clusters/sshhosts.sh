#!/usr/bin/env bash
# Real SSH test hosts on one machine: one network, PID, UTS and mount namespace per host, each
# with its own address, loopback, port space, process table, hostname and an sshd on :22.
#
#   sshhosts.sh up [N]    start hosts h1..hN (1-16, default 3); idempotent
#   sshhosts.sh down      stop everything this script started and leave the machine clean
#   sshhosts.sh status    print the hosts, their init and sshd pids (root namespace)
#
# Why namespaces and not several sshd on 127.0.0.x: on one shared loopback every "host" has the
# same interfaces, ports and hostname, so MASTER_ADDR, port and network-interface bugs stay
# hidden. Why a PID namespace too: with a shared process table, kill-by-tag run on one "host"
# also kills the job on every other one, so a lost-host test blames the wrong rank and "nothing
# left on any host" cannot tell per-host cleanup from a cross-host kill. Here a host sees and
# signals only its own processes. Only the filesystem is shared (a venv and scripts are visible
# on every host); the root namespace still sees every process, under root-namespace pids.
#
# Layout (all names start with "orch-" so teardown can find them without any state file):
#   root namespace: bridge orch-br0 = 198.18.8.1/24, veth orch-v<i> enslaved to it,
#                   "unreachable 198.18.8.0/24 metric 4000" so nothing leaves if the bridge is down
#   namespace orch-h<i>: lo, eth0 = 198.18.8.(10+i)/24, no default route
#   host h<i>:      inside orch-h<i>, `unshare --uts --pid --fork --kill-child --mount
#                   --propagation private --mount-proc` runs host-init.sh as PID 1: it sets the
#                   hostname h<i>, bind-mounts an empty file over root's ~/.bashrc (this host's
#                   mount namespace only), runs `sshd -D` on 0.0.0.0:22 as its child, reaps
#                   orphans, and ends the host (the kernel kills its whole PID namespace) on
#                   SIGTERM or when sshd exits
#   /etc/hosts: "198.18.8.(10+i) h<i>" and "::ffff:198.18.8.(10+i) h<i>" (the IPv4-mapped line
#                   keeps torch's TCPStore reverse lookups away from DNS), marked for removal
# 198.18.0.0/15 is reserved for benchmarking networks (RFC 2544): unlike 10/8 or 192.168/16 no
# office, VPN or cloud network uses it, so the test hosts never shadow a real one.
#
# State dir ($ORCHESTRATE_SSH_DIR, default /tmp/orchestrate-sshhosts; root-owned, 0755):
#   ssh_config  known_hosts  id_ed25519(.pub)  authorized_keys  hosts.txt  host-init.sh
#   blank-bashrc  h<i>/{sshd_config, ssh_host_ed25519_key, init.pid, sshd.pid, sshd.nspid,
#   sshd.log, init.log}
#   init.pid and sshd.pid hold root-namespace pids (what `kill` and /proc here understand);
#   sshd.nspid is the pid sshd wrote itself, as seen inside its host.
# Keys are throwaway, but kept across `up` calls so known_hosts stays valid; `down` deletes them.
set -euo pipefail

readonly NET_PREFIX=198.18.8          # a /24 of the benchmarking range; .1 is the bridge
readonly NET_CIDR="${NET_PREFIX}.0/24"
readonly HOST_OFFSET=10                # h<i> gets ${NET_PREFIX}.(HOST_OFFSET+i)
readonly UNREACHABLE_METRIC=4000
readonly BRIDGE=orch-br0
readonly NS_PREFIX=orch-h
readonly VETH_PREFIX=orch-v
readonly IFACE=eth0                    # the interface name inside every namespace
readonly MAX_HOSTS=16
readonly HOSTS_MARK="# orchestrate-sshhosts"
readonly STATE_MARK=.orchestrate-sshhosts
readonly SSHD=/usr/sbin/sshd
readonly LOCK_FILE=/run/lock/orchestrate-sshhosts.lock
STATE_DIR="${ORCHESTRATE_SSH_DIR:-/tmp/orchestrate-sshhosts}"
declare -A LAUNCHED=()                 # host number -> pid of the `unshare` this run started
WAIT_SECONDS="${ORCHESTRATE_SSH_WAIT:-30}"

die() {
    echo "sshhosts: error: $*" >&2
    exit 1
}

log() {
    echo "sshhosts: $*" >&2
}

usage() {
    sed -n '2,7p' "$0" | sed 's/^# \{0,1\}//' >&2
    exit 2
}

host_addr() { echo "${NET_PREFIX}.$((HOST_OFFSET + $1))"; }

# Namespaces this script owns, by number, whatever N the last `up` used.
our_host_numbers() {
    ip netns list 2>/dev/null | awk '{print $1}' | sed -n "s/^${NS_PREFIX}\([0-9][0-9]*\)$/\1/p" \
        | sort -n
}

# ---------------------------------------------------------------------------- packages

# Installs what is missing, and only then touches apt. A freshly installed openssh-server must
# not start a system sshd on the root namespace's :22, so services are blocked while apt runs.
ensure_packages() {
    local pkg missing=()
    for pkg in openssh-server openssh-client iproute2 pdsh; do
        if [[ "$(dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null || true)" != "install ok installed" ]]
        then
            missing+=("$pkg")
        fi
    done
    if [[ ${#missing[@]} -eq 0 ]]; then return 0; fi
    log "installing ${missing[*]}"
    local policy=/usr/sbin/policy-rc.d made_policy=0
    if [[ ! -e "$policy" ]]; then
        printf '#!/bin/sh\nexit 101\n' >"$policy"
        chmod 0755 "$policy"
        made_policy=1
    fi
    local rc=0
    {
        export DEBIAN_FRONTEND=noninteractive
        # Another apt (a second test cluster script) may hold the dpkg lock: wait for it.
        apt-get update -q -o DPkg::Lock::Timeout=300 &&
            apt-get install -y -q --no-install-recommends -o DPkg::Lock::Timeout=300 \
                -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold \
                "${missing[@]}"
    } >&2 || rc=$?
    if [[ $made_policy -eq 1 ]]; then rm -f "$policy"; fi
    [[ $rc -eq 0 ]] || die "apt-get could not install ${missing[*]} (exit $rc)"
    [[ -x "$SSHD" ]] || die "$SSHD missing after installing openssh-server"
}

# ---------------------------------------------------------------------------- state dir

# The state dir is deleted by `down`, so it must be one this script made: a marker file says so.
prepare_state_dir() {
    if [[ -d "$STATE_DIR" && ! -e "$STATE_DIR/$STATE_MARK" ]] \
        && [[ -n "$(ls -A "$STATE_DIR")" ]]; then
        die "$STATE_DIR exists, is not empty and was not made by this script" \
            "(set ORCHESTRATE_SSH_DIR to a new path)"
    fi
    mkdir -p "$STATE_DIR"
    chown root:root "$STATE_DIR"
    chmod 0755 "$STATE_DIR"
    touch "$STATE_DIR/$STATE_MARK"
    if [[ ! -f "$STATE_DIR/id_ed25519" ]]; then
        ssh-keygen -q -t ed25519 -N '' -C orchestrate-sshhosts-client -f "$STATE_DIR/id_ed25519"
    fi
    chmod 0600 "$STATE_DIR/id_ed25519"
    cp "$STATE_DIR/id_ed25519.pub" "$STATE_DIR/authorized_keys"
    chmod 0644 "$STATE_DIR/authorized_keys"
    mkdir -p /run/sshd                 # sshd's compiled-in privilege separation dir
    chmod 0755 /run/sshd
}

# ---------------------------------------------------------------------------- network

ensure_bridge() {
    if ! ip link show "$BRIDGE" >/dev/null 2>&1; then
        ip link add "$BRIDGE" type bridge
    fi
    # Outputs are captured before matching: `grep -q` in a pipe under pipefail can see SIGPIPE.
    if [[ "$(ip -o -4 addr show dev "$BRIDGE")" != *" ${NET_PREFIX}.1/24 "* ]]; then
        ip addr add "${NET_PREFIX}.1/24" dev "$BRIDGE"
    fi
    ip link set "$BRIDGE" up
    if [[ "$(ip route show type unreachable "$NET_CIDR")" != *"metric ${UNREACHABLE_METRIC}"* ]]; then
        ip route add unreachable "$NET_CIDR" metric "$UNREACHABLE_METRIC"
    fi
}

# Refuses to start if someone else already uses the range: our traffic would go to them.
check_range_free() {
    local line
    line="$(ip -o -4 addr show | awk -v p="${NET_PREFIX}." -v br="$BRIDGE" \
        'index($4, p) == 1 && $2 != br {print $2 " " $4; exit}')"
    [[ -z "$line" ]] || die "$NET_CIDR is already in use on this machine ($line)"
}

ensure_netns() {
    local i=$1 ns="${NS_PREFIX}$1" veth="${VETH_PREFIX}$1" addr
    addr="$(host_addr "$i")"
    if [[ ! -e "/run/netns/$ns" ]]; then
        ip netns add "$ns"
    fi
    if ! ip link show "$veth" >/dev/null 2>&1; then
        ip -n "$ns" link del "$IFACE" 2>/dev/null || true
        ip link add "$veth" type veth peer name "$IFACE" netns "$ns"
    fi
    ip link set "$veth" master "$BRIDGE"
    ip link set "$veth" up
    ip -n "$ns" link set lo up
    if [[ "$(ip -n "$ns" -o -4 addr show dev "$IFACE")" != *" ${addr}/24 "* ]]; then
        ip -n "$ns" addr add "${addr}/24" dev "$IFACE"
    fi
    ip -n "$ns" link set "$IFACE" up
}

# ---------------------------------------------------------------------------- sshd

# Root may log in with the key only. When root's password is locked ('!' in shadow), sshd with
# UsePAM no calls the account locked and refuses even a key; with PAM it lets the key in.
use_pam() {
    local field
    field="$(getent shadow root | cut -d: -f2)"
    if [[ "$field" == '!'* ]]; then echo yes; else echo no; fi
}

write_sshd_config() {
    local i=$1 dir="$STATE_DIR/h$1" pam=$2
    cat >"$dir/sshd_config" <<EOF
# Written by tests/clusters/sshhosts.sh for test host h$i; throwaway.
Port 22
AddressFamily inet
ListenAddress 0.0.0.0
HostKey $dir/ssh_host_ed25519_key
# Written by sshd itself once it listens: its pid inside the host PID namespace.
PidFile $dir/sshd.nspid
AuthorizedKeysFile $STATE_DIR/authorized_keys
PermitRootLogin prohibit-password
AuthenticationMethods publickey
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM $pam
# The state dir sits under /tmp by default; StrictModes refuses a path through a 1777 dir.
StrictModes no
# The default 10:30:100 drops parallel connects past 10 at random.
MaxStartups 200:30:400
MaxSessions 64
UseDNS no
ClientAliveInterval 5
ClientAliveCountMax 3
PrintMotd no
PrintLastLog no
X11Forwarding no
AcceptEnv LANG LC_*
Subsystem sftp /usr/lib/openssh/sftp-server
LogLevel INFO
EOF
}

# PID 1 of every host. Bash, not python, so the hosts need nothing beyond the base system.
# A process that is PID 1 of a PID namespace gets only the signals it has a handler for, hence
# the TERM trap; `wait` reaps every child, orphans re-parented to PID 1 included, so sessions
# that die leave no zombies. When this script exits, the kernel SIGKILLs the rest of the host.
write_host_init() {
    cat >"$STATE_DIR/host-init.sh.tmp" <<'INIT'
# PID 1 of one SSH test host; written and started by tests/clusters/sshhosts.sh.
# Args: HOSTNAME SSHD SSHD_CONFIG SSHD_LOG BLANK_FILE BASHRC
set -u
hostname "$1" || exit 1
# Root's ~/.bashrc runs for every ssh command; a heavy one (pyenv init) would dominate timings.
# This mount namespace is private to the host: the machine's own ~/.bashrc stays as it is.
if [ -f "$6" ]; then mount --bind "$5" "$6" || exit 1; fi
trap 'exit 143' TERM
# Bash ignores INT and QUIT in background jobs; sshd gets the dispositions a service manager
# would give it, so the processes of ssh sessions do too.
( trap - INT QUIT TERM; exec "$2" -D -f "$3" -E "$4" ) &
listener=$!
wait "$listener"
exit $?
INIT
    # A new inode: a running init keeps reading the script it started with.
    mv "$STATE_DIR/host-init.sh.tmp" "$STATE_DIR/host-init.sh"
    : >"$STATE_DIR/blank-bashrc"
    chmod 0644 "$STATE_DIR/host-init.sh" "$STATE_DIR/blank-bashrc"
}

# The root-namespace pid of the process that is pid $2 inside host $1 (NSpid lists a process's
# pid in each PID namespace it belongs to, outermost first: "NSpid: <root> <host>").
host_root_pid() {
    local ns="${NS_PREFIX}$1" want=$2 pid fields
    for pid in $(ip netns pids "$ns" 2>/dev/null || true); do
        fields="$(awk '$1 == "NSpid:" {print NF - 1, $NF}' "/proc/$pid/status" 2>/dev/null \
            || true)"
        if [[ "$fields" == "2 $want" ]]; then
            echo "$pid"
            return 0
        fi
    done
    return 1
}

# Whether a pid is a live process; a zombie (exited, not yet reaped) is not.
running() {
    local state
    [[ "$1" =~ ^[0-9]+$ ]] || return 1
    state="$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null || true)"
    [[ -n "$state" && "$state" != Z ]]
}

# The pid (root namespace) in h<i>/$2, if that process still lives in host $1's namespaces.
recorded_pid() {
    local pidfile="$STATE_DIR/h$1/$2" pid
    [[ -f "$pidfile" ]] || return 1
    pid="$(cat "$pidfile")"
    running "$pid" || return 1
    [[ "$(stat -L -c %i "/proc/$pid/ns/net" 2>/dev/null || true)" \
        == "$(stat -L -c %i "/run/netns/${NS_PREFIX}$1" 2>/dev/null || echo none)" ]] || return 1
    echo "$pid"
}

init_pid() { recorded_pid "$1" init.pid; }
sshd_pid() { recorded_pid "$1" sshd.pid; }

# The pids in the network namespaces of hosts "$@" (one line per namespace, may be empty).
netns_pids() {
    local i
    for i in "$@"; do ip netns pids "${NS_PREFIX}$i" 2>/dev/null || true; done
}

# SIGTERM to everything in the network namespaces of hosts "$@", all at once: each host's init
# (whose exit ends its PID namespace) and what a test may have started there with `ip netns
# exec`; SIGKILL what is left after ~2 s (SIGKILL to `unshare` ends its init: --kill-child).
stop_host_processes() {
    local pids tries
    pids="$(netns_pids "$@")"
    [[ -n "${pids//[[:space:]]/}" ]] || return 0
    # shellcheck disable=SC2086  # word splitting of the pid list is intended
    kill -TERM $pids 2>/dev/null || true
    for ((tries = 0; tries < 20; tries++)); do
        pids="$(netns_pids "$@")"
        [[ -z "${pids//[[:space:]]/}" ]] && return 0
        sleep 0.1
    done
    # shellcheck disable=SC2086
    kill -KILL $pids 2>/dev/null || true
    for ((tries = 0; tries < 20; tries++)); do
        pids="$(netns_pids "$@")"
        [[ -z "${pids//[[:space:]]/}" ]] && return 0
        sleep 0.1
    done
    log "processes still in the hosts' namespaces after SIGKILL: $(tr '\n' ' ' <<<"$pids")"
}

ensure_host() {
    local i=$1 ns="${NS_PREFIX}$1" dir="$STATE_DIR/h$1" pam=$2 bashrc
    mkdir -p "$dir"
    if [[ ! -f "$dir/ssh_host_ed25519_key" ]]; then
        ssh-keygen -q -t ed25519 -N '' -C "h$i" -f "$dir/ssh_host_ed25519_key"
    fi
    write_sshd_config "$i" "$pam"
    "$SSHD" -t -f "$dir/sshd_config" || die "h$i: $SSHD rejects $dir/sshd_config"
    if init_pid "$i" >/dev/null && sshd_pid "$i" >/dev/null; then
        return 0
    fi
    # Half a host (a crash during `up`, an sshd that died): start it again from nothing.
    stop_host_processes "$i"
    rm -f "$dir/init.pid" "$dir/sshd.pid" "$dir/sshd.nspid"
    bashrc="$(getent passwd root | cut -d: -f6)/.bashrc"
    # setsid: the host outlives this script and its terminal; 9>&-: it must not inherit the
    # lock this script holds, or the next `down` would wait for the host to end.
    setsid ip netns exec "$ns" unshare --uts --pid --fork --kill-child --mount \
        --propagation private --mount-proc \
        bash "$STATE_DIR/host-init.sh" "h$i" "$SSHD" "$dir/sshd_config" "$dir/sshd.log" \
        "$STATE_DIR/blank-bashrc" "$bashrc" </dev/null >>"$dir/init.log" 2>&1 9>&- &
    LAUNCHED[$i]=$!
}

# Once sshd has written its own pid (it does so after binding :22), records the root-namespace
# pids of the host's init and sshd for `down`, `status` and the tests.
record_pids() {
    local i=$1 dir="$STATE_DIR/h$1" nspid init sshd
    [[ -s "$dir/sshd.nspid" ]] || return 1
    nspid="$(cat "$dir/sshd.nspid")"
    init="$(host_root_pid "$i" 1)" || return 1
    sshd="$(host_root_pid "$i" "$nspid")" || return 1
    echo "$init" >"$dir/init.pid"
    echo "$sshd" >"$dir/sshd.pid"
}

# ---------------------------------------------------------------------------- client files

write_client_files() {
    local n=$1 i addr pub names=""
    local cfg="$STATE_DIR/ssh_config" kh="$STATE_DIR/known_hosts" hosts="$STATE_DIR/hosts.txt"
    : >"$cfg.tmp"
    : >"$kh.tmp"
    : >"$hosts.tmp"
    for ((i = 1; i <= n; i++)); do
        addr="$(host_addr "$i")"
        printf 'Host h%d\n    HostName %s\n\n' "$i" "$addr" >>"$cfg.tmp"
        pub="$(cut -d' ' -f1,2 "$STATE_DIR/h$i/ssh_host_ed25519_key.pub")"
        printf 'h%d,%s %s\n' "$i" "$addr" "$pub" >>"$kh.tmp"
        printf 'h%d %s\n' "$i" "$addr" >>"$hosts.tmp"
        names+=" h$i"
    done
    cat >>"$cfg.tmp" <<EOF
Host${names}
    User root
    Port 22
    IdentityFile "$STATE_DIR/id_ed25519"
    IdentitiesOnly yes
    UserKnownHostsFile "$kh"
    GlobalKnownHostsFile /dev/null
    StrictHostKeyChecking yes
    CheckHostIP no
    BatchMode yes
    ConnectTimeout 5
    LogLevel ERROR
EOF
    mv "$cfg.tmp" "$cfg"
    mv "$kh.tmp" "$kh"
    mv "$hosts.tmp" "$hosts"
    chmod 0644 "$cfg" "$kh" "$hosts"
}

# /etc/hosts may be a bind mount (containers): rewrite it in place, never replace the file.
# Every edit holds `flock /etc/hosts`, as tests/clusters/slurm.sh's do: two scripts rewriting
# the file at once would lose each other's lines.
remove_etc_hosts_lines() {
    # shellcheck disable=SC2094  # $(grep) has read the whole file before printf rewrites it
    (
        flock -w 60 8 || die "could not lock /etc/hosts within 60 s"
        grep -qF "$HOSTS_MARK" /etc/hosts || exit 0
        local kept
        kept="$(grep -vF "$HOSTS_MARK" /etc/hosts || true)"
        printf '%s\n' "$kept" >/etc/hosts
    ) 8</etc/hosts
}

write_etc_hosts_lines() {
    local n=$1 i addr lines=""
    for ((i = 1; i <= n; i++)); do
        addr="$(host_addr "$i")"
        lines+="${addr} h${i} ${HOSTS_MARK}"$'\n'
        lines+="::ffff:${addr} h${i} ${HOSTS_MARK}"$'\n'
    done
    # shellcheck disable=SC2094
    (
        flock -w 60 8 || die "could not lock /etc/hosts within 60 s"
        if grep -qF "$HOSTS_MARK" /etc/hosts; then
            local kept
            kept="$(grep -vF "$HOSTS_MARK" /etc/hosts || true)"
            printf '%s\n' "$kept" >/etc/hosts
        fi
        [[ ! -s /etc/hosts || -z "$(tail -c 1 /etc/hosts)" ]] || echo >>/etc/hosts
        printf '%s' "$lines" >>/etc/hosts
    ) 8</etc/hosts
}

# ---------------------------------------------------------------------------- readiness

# Shows why host $1 is not up (its init's and sshd's own words) and exits.
host_failed() {
    local dir="$STATE_DIR/h$1"
    tail -n 5 "$dir/init.log" >&2 2>/dev/null || true
    tail -n 5 "$dir/sshd.log" >&2 2>/dev/null || true
    die "h$1: $2 (logs: $dir/init.log, $dir/sshd.log)"
}

# Ready means: the sshd answers with the host key we wrote into known_hosts, its pids are
# recorded, and a key login runs a command. All bounded by WAIT_SECONDS in total.
wait_ready() {
    local n=$1 deadline i addr got answers pending=() still=()
    deadline=$((SECONDS + WAIT_SECONDS))
    local -A want=()
    for ((i = 1; i <= n; i++)); do
        pending+=("$i")
        want[$i]="$(cut -d' ' -f2 "$STATE_DIR/h$i/ssh_host_ed25519_key.pub")"
    done
    while ((${#pending[@]} > 0)); do
        # One ssh-keyscan asks every host still pending, in parallel.
        local addrs=()
        for i in "${pending[@]}"; do addrs+=("$(host_addr "$i")"); done
        answers="$(ssh-keyscan -T 2 -t ed25519 "${addrs[@]}" 2>/dev/null || true)"
        still=()
        for i in "${pending[@]}"; do
            addr="$(host_addr "$i")"
            got="$(awk -v a="$addr" '$1 == a {print $3}' <<<"$answers")"
            if [[ "$got" == "${want[$i]}" ]] && record_pids "$i"; then continue; fi
            if [[ -z "$(ip netns pids "${NS_PREFIX}$i" 2>/dev/null || true)" ]] \
                && ! running "${LAUNCHED[$i]:-}"; then
                host_failed "$i" "the host ended while starting"
            fi
            still+=("$i")
        done
        pending=("${still[@]}")
        ((${#pending[@]} > 0)) || break
        if ((SECONDS >= deadline)); then
            i=${pending[0]}
            host_failed "$i" \
                "$(host_addr "$i"):22 did not answer with its host key within ${WAIT_SECONDS}s"
        fi
        sleep 0.2
    done
    local -A pids=()
    for ((i = 1; i <= n; i++)); do
        ssh -F "$STATE_DIR/ssh_config" -n "h$i" true 2>"$STATE_DIR/h$i/login.err" &
        pids[$i]=$!
    done
    local failed=""
    for ((i = 1; i <= n; i++)); do
        wait "${pids[$i]}" || failed+=" h$i"
    done
    if [[ -n "$failed" ]]; then
        for i in $failed; do
            log "$i: $(tr '\n' ' ' <"$STATE_DIR/$i/login.err")"
        done
        die "key login failed on:$failed (sshd logs in $STATE_DIR/h*/sshd.log)"
    fi
    rm -f "$STATE_DIR"/h*/login.err
}

# ---------------------------------------------------------------------------- teardown

# Stops hosts "$@" together (each one's init, so the kernel ends its whole PID namespace, and
# anything else in its network namespace), then removes their namespaces and veths.
hosts_down() {
    local i
    stop_host_processes "$@"
    for i in "$@"; do
        ip netns del "${NS_PREFIX}$i" 2>/dev/null || true
        ip link del "${VETH_PREFIX}$i" 2>/dev/null || true
        rm -rf "${STATE_DIR:?}/h$i"
    done
}

cmd_down() {
    local i
    # shellcheck disable=SC2046  # one host number per word
    hosts_down $(our_host_numbers)
    # A veth whose namespace is already gone (crash half-way through `up`).
    for i in $(seq 1 "$MAX_HOSTS"); do
        ip link del "${VETH_PREFIX}$i" 2>/dev/null || true
    done
    ip link del "$BRIDGE" 2>/dev/null || true
    while ip route del unreachable "$NET_CIDR" metric "$UNREACHABLE_METRIC" 2>/dev/null; do :; done
    remove_etc_hosts_lines
    if [[ -e "$STATE_DIR/$STATE_MARK" ]]; then
        rm -rf "${STATE_DIR:?}"
    fi
    log "down: no test hosts left"
}

# ---------------------------------------------------------------------------- up / status

cmd_up() {
    local n=${1:-3} i pam
    if ! [[ "$n" =~ ^[0-9]+$ ]] || ((n < 1 || n > MAX_HOSTS)); then
        die "up: N must be an integer from 1 to $MAX_HOSTS (got '$n')"
    fi
    ensure_packages
    check_range_free
    prepare_state_dir
    pam="$(use_pam)"
    # Hosts left over from a bigger `up` go away, so the set is exactly h1..hN.
    local extra=()
    for i in $(our_host_numbers); do
        if ((i > n)); then extra+=("$i"); fi
    done
    if ((${#extra[@]} > 0)); then hosts_down "${extra[@]}"; fi
    ensure_bridge
    write_host_init
    for ((i = 1; i <= n; i++)); do
        ensure_netns "$i"
        ensure_host "$i" "$pam"
    done
    write_client_files "$n"
    write_etc_hosts_lines "$n"
    wait_ready "$n"
    log "up: $n host(s) ready; ssh -F $STATE_DIR/ssh_config h1"
}

cmd_status() {
    local i addr state found=0
    for i in $(our_host_numbers); do
        found=1
        addr="$(host_addr "$i")"
        if init_pid "$i" >/dev/null; then state="init $(init_pid "$i")"; else state="no init"; fi
        if sshd_pid "$i" >/dev/null; then state+=" sshd $(sshd_pid "$i")"; else state+=" no sshd"; fi
        echo "h$i $addr ${NS_PREFIX}$i $state"
    done
    [[ $found -eq 1 ]] || echo "no test hosts"
}

main() {
    [[ $EUID -eq 0 ]] || die "must run as root (namespaces, /etc/hosts, sshd on :22)"
    local cmd=${1:-}
    [[ -n "$cmd" ]] || usage
    shift
    exec 9>"$LOCK_FILE"
    flock -w 300 9 || die "another sshhosts.sh holds $LOCK_FILE"
    case "$cmd" in
        up) cmd_up "$@" ;;
        down) cmd_down ;;
        status) cmd_status ;;
        *) usage ;;
    esac
}

main "$@"
