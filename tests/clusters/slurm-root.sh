#!/usr/bin/env bash
# A second Slurm release for the tests: Debian 13 (trixie)'s Slurm 24.11 in its own root, next
# to this machine's Debian 12 Slurm 22.05. `slurm.sh` runs a 3-node cluster from it
# (ORCHESTRATE_SLURM_RELEASE=2411); tests/setup.sh starts `root` in the background, so its
# minutes overlap the suite's first ones (docs/testing-clusters.md, "Second release").
#
#   tests/clusters/slurm-root.sh root        build the root once (debootstrap from Debian's
#                                            archive, with slurmctld slurmd slurm-client munge);
#                                            idempotent; prints its cost; while it runs,
#                                            $ROOT.building holds its PID (the tests wait on it)
#   tests/clusters/slurm-root.sh version     the root's Slurm release (sbatch --version)
#   tests/clusters/slurm-root.sh smoke OUT   a one-node 24.11 cluster inside the root, on
#                                            loopback ports 16917-16918 with its own munge, in a
#                                            private mount namespace: runs a batch job, a failing
#                                            one, a held one named with " JobState=COMPLETED",
#                                            writes their `scontrol show job/node` (multi-line and
#                                            --oneliner) to OUT, and tears everything down
#
# Settings: ORCHESTRATE_SLURM_ROOT (default /var/cache/orchestrate/slurm-trixie),
# ORCHESTRATE_DEBIAN_MIRROR (default http://deb.debian.org/debian).
# Root only (debootstrap, chroot, mounts). Everything the smoke cluster writes stays under the
# root's /tmp/orchestrate-slurm-2411; no process is ever chosen by name.
set -euo pipefail

ROOT=${ORCHESTRATE_SLURM_ROOT:-/var/cache/orchestrate/slurm-trixie}
MIRROR=${ORCHESTRATE_DEBIAN_MIRROR:-http://deb.debian.org/debian}
# libffi8 and libexpat1: the machine's Python runs inside the root as the jobs' Python (ctypes,
# which torch imports, and pyexpat need them; Debian 13's minbase has neither).
PACKAGES=slurmctld,slurmd,slurm-client,munge,libffi8,libexpat1
INNER=/tmp/orchestrate-slurm-2411 # the smoke cluster's directory, as seen inside the root
PORT=16917

die() { echo "slurm-root.sh: $*" >&2; exit 1; }

building() { # the PID of a build under way, if any
  local pid
  read -r pid 2>/dev/null <"$ROOT.building" || return 1
  [[ -n $pid ]] && kill -0 "$pid" 2>/dev/null && echo "$pid"
}

do_root() {
  if [[ -x $ROOT/usr/sbin/slurmctld && -e $ROOT/.orchestrate-slurm-root ]]; then
    add_libraries
    echo "root ready: $ROOT ($(do_version))"
    return
  fi
  local pid
  if pid=$(building); then
    echo "root being built by PID $pid: $ROOT"
    return
  fi
  mkdir -p "$(dirname "$ROOT")"
  echo $$ >"$ROOT.building"
  trap 'rm -f "$ROOT.building"' EXIT
  command -v debootstrap >/dev/null ||
    apt-get -o DPkg::Lock::Timeout=120 install -y -qq --no-install-recommends debootstrap ||
    die "debootstrap is missing and could not be installed"
  # A build that died half way leaves debootstrap's own directory: start again from nothing.
  if [[ -d $ROOT/debootstrap && ! -e $ROOT/.orchestrate-slurm-root ]]; then rm -rf "${ROOT:?}"; fi
  local start=$SECONDS
  debootstrap --variant=minbase --include="$PACKAGES" trixie "$ROOT" "$MIRROR" >"$ROOT.log" 2>&1 ||
    die "debootstrap failed: see $ROOT.log"
  local debs
  debs=$(du -sm "$ROOT/var/cache/apt/archives" | cut -f1)
  rm -f "$ROOT"/var/cache/apt/archives/*.deb
  touch "$ROOT/.orchestrate-slurm-root"
  echo "root built in $((SECONDS - start)) s (${debs} MB of packages): $ROOT ($(do_version))"
}

# chroot and env exec the program: a daemon started `in_root ... &` from a function would be a
# subshell's child, and its PID ($!) the subshell's; `exec` keeps the daemon's PID in $!.
in_root() { exec_in_root "$@"; }
exec_in_root() {
  (exec chroot "$ROOT" env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin \
    SLURM_CONF="$INNER/slurm.conf" "$@")
}
daemon_in_root() { # name, then the command: runs in the background, its PID in DAEMONS
  local name=$1
  shift
  chroot "$ROOT" env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin SLURM_CONF="$INNER/slurm.conf" \
    "$@" >"$ROOT$INNER/log/$name.out" 2>&1 &
  DAEMONS+=($!)
}

add_libraries() { # a root built before the jobs' libraries were in PACKAGES gets them
  compgen -G "$ROOT/usr/lib/*/libffi.so.8" >/dev/null && return 0
  cp /etc/resolv.conf "$ROOT/etc/resolv.conf" 2>/dev/null || true
  chroot "$ROOT" env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin DEBIAN_FRONTEND=noninteractive \
    apt-get install -y -qq --no-install-recommends libffi8 libexpat1 >>"$ROOT.log" 2>&1 ||
    die "could not add libffi8 libexpat1 to $ROOT: see $ROOT.log"
}

do_version() { in_root sbatch --version 2>/dev/null || echo "no Slurm in $ROOT"; }

write_conf() {
  local host=$1
  cat >"$ROOT$INNER/slurm.conf" <<EOF
ClusterName=orchestrate2411
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$INNER/munge/munge.socket,cred_expire=10
StateSaveLocation=$INNER/ctld
SlurmctldPidFile=$INNER/slurmctld.pid
SlurmctldLogFile=$INNER/log/slurmctld.log
SlurmdSpoolDir=$INNER/spool/%n
SlurmdPidFile=$INNER/slurmd-%n.pid
SlurmdLogFile=$INNER/log/slurmd-%n.log
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerParameters=bf_interval=1,sched_interval=2
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
SwitchType=switch/none
MailProg=/bin/true
ReturnToService=2
MinJobAge=3600
NodeName=n1 NodeHostname=$host NodeAddr=127.0.0.1 Port=$((PORT + 1)) CPUs=2 RealMemory=1000
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
}

wait_until() { # seconds, then a command
  local until=$((SECONDS + $1))
  shift
  until "$@" >/dev/null 2>&1; do
    ((SECONDS < until)) || return 1
    sleep 0.2
  done
}

smoke_inside() { # runs in a private mount namespace: the mounts go with it
  local out=$1 host rc=0
  host=$(hostname -s)
  mount -t proc proc "$ROOT/proc"
  mount --rbind /dev "$ROOT/dev"
  mount --rbind /sys "$ROOT/sys"
  cp /etc/hosts "$ROOT/etc/hosts"
  echo "$host" >"$ROOT/etc/hostname"
  rm -rf "${ROOT:?}$INNER"
  mkdir -p "$ROOT$INNER"/{munge,ctld,spool,log}
  chmod 700 "$ROOT$INNER/munge"
  dd if=/dev/urandom of="$ROOT$INNER/munge/munge.key" bs=1024 count=1 status=none
  chmod 400 "$ROOT$INNER/munge/munge.key"
  chmod 755 "$ROOT$INNER" "$ROOT$INNER/munge"
  write_conf "$host"
  DAEMONS=()
  daemon_in_root munged munged -F --force --key-file="$INNER/munge/munge.key" \
    --socket="$INNER/munge/munge.socket" --pid-file="$INNER/munge/munged.pid" \
    --seed-file="$INNER/munge/munged.seed"
  if wait_until 20 test -S "$ROOT$INNER/munge/munge.socket"; then
    daemon_in_root slurmctld slurmctld -D
    if wait_until 30 in_root scontrol ping; then
      daemon_in_root slurmd slurmd -D -N n1
      wait_until 30 bash -c "chroot '$ROOT' env SLURM_CONF=$INNER/slurm.conf \
        sinfo -h -N -t idle | grep -q n1" || rc=1
    else rc=1; fi
  else rc=1; fi
  if ((rc == 0)); then smoke_jobs "$out" || rc=$?; else tail -n 20 "$ROOT$INNER/log/"* >&2; fi
  stop_daemons
  return "$rc"
}

stop_daemons() { # SIGTERM, then SIGKILL after 3 s; plus every process left with the root as
  # its root directory (slurmscriptd, slurmstepd, job tasks), found by /proc/PID/root
  local left=() p r
  kill -TERM "${DAEMONS[@]}" 2>/dev/null || true
  for ((i = 0; i < 30; i++)); do
    left=()
    for p in /proc/[0-9]*; do
      r=$(readlink "$p/root" 2>/dev/null) || continue
      [[ $r == "$ROOT" ]] && left+=("${p#/proc/}")
    done
    ((${#left[@]} == 0)) && break
    ((i == 10)) && kill -TERM "${left[@]}" 2>/dev/null
    ((i == 29)) && kill -KILL "${left[@]}" 2>/dev/null
    sleep 0.1
  done
  wait 2>/dev/null || true
}

smoke_jobs() {
  local out=$1 ok failing held
  mkdir -p "$out"
  in_root sbatch --version >"$out/version.txt"
  ok=$(in_root sbatch --parsable -o /dev/null --wrap 'srun hostname')
  failing=$(in_root sbatch --parsable -o /dev/null --wrap 'exit 3')
  held=$(in_root sbatch --parsable --hold -J 'evil JobState=COMPLETED x' \
    --comment='c JobState=COMPLETED Reason=None ExitCode=0:0' -o /dev/null --wrap true)
  wait_until 60 bash -c "! chroot '$ROOT' env SLURM_CONF=$INNER/slurm.conf \
    squeue -h -t pd,r,cg -j $ok,$failing -o %T | grep -q ." || die "jobs did not end"
  for job in ok:$ok failing:$failing held:$held; do
    in_root scontrol show job "${job#*:}" >"$out/job-${job%%:*}.txt"
    in_root scontrol show job --oneliner "${job#*:}" >"$out/job-${job%%:*}-oneliner.txt"
  done
  in_root squeue -h -t all -o '%i|%T|%r|%j' >"$out/squeue.txt"
  in_root scontrol show node n1 >"$out/node.txt"
  in_root scontrol show node --oneliner n1 >"$out/node-oneliner.txt"
  in_root scontrol --json show job "$held" >"$out/job-held.json" 2>&1 || true
  in_root scancel "$held"
  echo "smoke: $(cat "$out/version.txt"): outputs in $out"
}

case ${1:-} in
  root) do_root ;;
  version) do_version ;;
  smoke)
    [[ -n ${2:-} ]] || die "usage: $0 smoke OUT_DIR"
    [[ -e $ROOT/.orchestrate-slurm-root ]] || die "no root at $ROOT: run '$0 root' first"
    out=$(realpath -m "$2")
    export ROOT INNER PORT
    unshare --mount --propagation private bash -c \
      "source '${BASH_SOURCE[0]}' --functions; smoke_inside '$out'"
    ;;
  --functions) ;; # sourced by smoke's mount namespace
  *) die "usage: $0 root|version|smoke OUT_DIR" ;;
esac
