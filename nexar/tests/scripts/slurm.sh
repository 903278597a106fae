#!/usr/bin/env bash
# Runs a program as four tasks of one `srun` step on a real, private, one-node SLURM cluster
# (munged + slurmctld + slurmd) started on this machine, then stops the cluster again.
#
#   bash nexar/tests/scripts/slurm.sh <program> [args...]
#
# Everything the cluster needs (slurm.conf, munge key and socket, state and spool directories,
# logs, pid files) lives in a fresh directory under ${TMPDIR:-/tmp}, so a system configuration
# that may exist (/etc/slurm, /etc/munge, a running system munged) is never read or touched, and
# several runs at once do not collide: the daemons' ports and the first job id are picked free.
#
# The step is `srun --overcommit -N1 -n 4 --time=5 --kill-on-bad-exit=1 --export=ALL <program>`:
# the tasks get the caller's environment (NEXAR_SECRET, ...) plus srun's SLURM_* variables, and
# their stdout/stderr pass through. The script exits with srun's exit code.
#
# Needs root and the Debian/Ubuntu packages slurmctld, slurmd, slurm-client and munge (no systemd
# needed). Without them it prints one line starting with "SLURM NOT RUN:" and exits 77.
#
# Tested with Slurm 22.05 (Debian 12) and munge 0.5.15.
set -euo pipefail

NODES=1   # nodes of the one-node cluster (do not change: the config below has one node line)
TASKS=4   # tasks of the srun step
CPUS=4    # CPUs the node claims (config_overrides lets it claim more than the machine has)

not_run() {
  echo "SLURM NOT RUN: $*"
  exit 77
}

if [ "$#" -lt 1 ]; then
  echo "usage: $0 <program> [args...]" >&2
  exit 2
fi
[ "$(id -u)" = 0 ] || not_run "needs root (the private slurmd runs as root to start tasks)"
for tool in slurmctld slurmd srun sinfo scontrol munged; do
  # The daemons live in /usr/sbin, which may not be on a non-login PATH.
  command -v "$tool" >/dev/null 2>&1 || [ -x "/usr/sbin/$tool" ] ||
    not_run "$tool is not installed (apt-get install slurmctld slurmd slurm-client munge)"
done
export PATH="$PATH:/usr/sbin:/sbin"

# Anything SLURM_* inherited from an outer allocation (this script may itself run under SLURM)
# would make srun join that job instead of ours; the config file is set below.
while IFS= read -r var; do unset "$var"; done < <(compgen -e | grep '^SLURM_' || true)

WORK=$(mktemp -d "${TMPDIR:-/tmp}/nexar-slurm.XXXXXX")
mkdir -p "$WORK/state" "$WORK/spool" "$WORK/log" "$WORK/run" "$WORK/munge"
# munged wants the directories on its socket's path writable by no one but their owner, and
# searchable by all (whatever the umask made them).
chmod 0755 "$WORK" "$WORK/munge"
export SLURM_CONF="$WORK/slurm.conf"

MUNGED_PID=""
SRUN_PID=""
SLURMCTLD_PID=""
SLURMD_PID=""
SRUN_STATUS=1

# Stops one daemon: SIGTERM, up to ~10 s to exit, then SIGKILL.
# shellcheck disable=SC2317  # (shellcheck 0.9 thinks functions run only from a trap unreachable)
stop_daemon() {
  local pid=$1 _
  [ -n "$pid" ] || return 0
  kill -TERM "$pid" 2>/dev/null || return 0
  for _ in $(seq 1 100); do
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.1
  done
  if kill -0 "$pid" 2>/dev/null; then
    echo "slurm.sh: pid $pid did not stop on SIGTERM, killing it" >&2
    kill -KILL "$pid" 2>/dev/null || true
  fi
  wait "$pid" 2>/dev/null || true
}

# Runs at exit, whatever ended the script: stops the daemons, shows their logs if something
# failed, removes the work directory, and exits with the script's status (srun's, once it ran).
# shellcheck disable=SC2317
cleanup() {
  local status=$?
  trap - EXIT INT TERM
  # If a signal ended the script while the step ran, end the step (timeout passes SIGTERM on
  # to srun, which cancels the step and the job).
  stop_daemon "$SRUN_PID"
  # Let the job finish completing, so that no slurmstepd of it outlives the cluster.
  if [ -n "$SLURMCTLD_PID" ] && kill -0 "$SLURMCTLD_PID" 2>/dev/null; then
    local _
    for _ in $(seq 1 50); do
      [ -z "$(squeue -h -o %i 2>/dev/null)" ] && break
      sleep 0.2
    done
  fi
  # slurmd first (it stops the step daemons it started), then the controller, then munge.
  stop_daemon "$SLURMD_PID"
  stop_daemon "$SLURMCTLD_PID"
  stop_daemon "$MUNGED_PID"
  if [ "$SRUN_STATUS" != 0 ] || [ "$status" != 0 ]; then
    # Each daemon's log file, or what it wrote to stdout/stderr (under -D the same lines, plus
    # what it said before it opened its log file) where it made no log file.
    local d f
    for d in munged slurmctld slurmd; do
      f="$WORK/log/$d.log"
      [ -s "$f" ] || f="$WORK/log/$d.out"
      [ -s "$f" ] || continue
      echo "---- slurm.sh: tail of ${f##*/} ----" >&2
      tail -n 30 "$f" >&2
    done
  fi
  rm -rf "$WORK"
  exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# TCP ports something listens on now, in decimal, one a line (IPv4 and IPv6).
listening_ports() {
  local _sl local_addr _rem st _rest
  cat /proc/net/tcp /proc/net/tcp6 2>/dev/null |
    while read -r _sl local_addr _rem st _rest; do
      # st 0A is TCP_LISTEN; the local address is HEXADDR:HEXPORT.
      if [ "$st" = 0A ]; then echo $((16#${local_addr##*:})); fi
    done
}
# A port in [base, base + span) that nothing listens on and that is not in $2 (space separated).
free_port() {
  local base=$1 taken=$2 span=10000 p _
  local busy
  busy=" $(listening_ports | tr '\n' ' ') $taken "
  for _ in $(seq 1 200); do
    p=$((base + (RANDOM * 32768 + RANDOM + $$) % span))
    case "$busy" in *" $p "*) continue ;; esac
    echo "$p"
    return 0
  done
  echo "slurm.sh: found no free port in $base..$((base + span - 1))" >&2
  return 1
}
# The daemons' ports come from 10000..19999: below the kernel's ephemeral range (32768..) and
# below nexar's SLURM seed ports (20000 + job id % 20000).
CTLD_PORT=$(free_port 10000 "")
SLURMD_PORT=$(free_port 10000 "$CTLD_PORT")
# The job id sets the seed port (20000 + id % 20000): start jobs at a random id whose seed port
# is free, so that runs at the same time get different seed ports.
SEED_PORT=$(free_port 20000 "")
FIRST_JOB_ID=$((SEED_PORT - 20000 + 20000 * (1 + RANDOM % 100)))

# The node is named after this host, so that SLURM_STEP_NODELIST names a host the tasks can
# resolve (nexar's rank 0 hosts the seed on the first host of that list). The daemons talk over
# 127.0.0.1 whatever the name resolves to. If the short hostname does not resolve, the node is
# called localhost instead, which always does.
NODE=$(hostname -s 2>/dev/null || hostname)
if ! getent hosts "$NODE" >/dev/null 2>&1; then
  echo "slurm.sh: '$NODE' does not resolve (getent hosts), naming the node localhost" >&2
  NODE=localhost
fi

# ---- munge: a private key, socket and daemon ----------------------------------------------
KEY="$WORK/munge/munge.key"
SOCKET="$WORK/munge/munge.socket"
if command -v mungekey >/dev/null 2>&1; then
  mungekey --create --keyfile="$KEY" >/dev/null
else
  dd if=/dev/urandom of="$KEY" bs=1 count=1024 status=none
fi
chmod 0400 "$KEY"
# --force: munged as root, and lets it start despite permission quirks of the parent
# directories (e.g. a TMPDIR that is group-writable). In the foreground it logs to stderr
# (munged.out) rather than to --log-file.
munged --foreground --force \
  --socket="$SOCKET" --key-file="$KEY" --pid-file="$WORK/run/munged.pid" \
  --log-file="$WORK/log/munged.log" --seed-file="$WORK/munge/munged.seed" \
  >>"$WORK/log/munged.out" 2>&1 &
MUNGED_PID=$!
for _ in $(seq 1 100); do
  [ -S "$SOCKET" ] && break
  kill -0 "$MUNGED_PID" 2>/dev/null || { echo "slurm.sh: munged exited at start" >&2; exit 1; }
  sleep 0.1
done
[ -S "$SOCKET" ] || { echo "slurm.sh: munged made no socket in 10 s" >&2; exit 1; }

# ---- slurm.conf --------------------------------------------------------------------------
# cons_tres where its plugin is installed (Slurm >= 19.05 has it), else linear.
plugin_installed() { [ -n "$(find /usr/lib* /usr/local/lib* -name "$1.so" -print -quit 2>/dev/null)" ]; }
SELECT=select/cons_tres
if ! plugin_installed select_cons_tres && plugin_installed select_linear; then SELECT=select/linear; fi

cat >"$SLURM_CONF" <<EOF
# Private one-node cluster of nexar/tests/scripts/slurm.sh; removed when the script ends.
ClusterName=nexartest
SlurmctldHost=$NODE(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$SOCKET
FirstJobId=$FIRST_JOB_ID

StateSaveLocation=$WORK/state
SlurmdSpoolDir=$WORK/spool
SlurmctldPidFile=$WORK/run/slurmctld.pid
SlurmdPidFile=$WORK/run/slurmd.pid
SlurmctldLogFile=$WORK/log/slurmctld.log
SlurmdLogFile=$WORK/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info

# No cgroups, no accounting, no MPI plugin: nothing beyond the plain daemons. (SwitchType and
# JobCompType stay unset: their "none" plugins are gone from Slurm 23.)
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
SchedulerType=sched/builtin
SelectType=$SELECT
SelectTypeParameters=CR_Core
ReturnToService=2
# Take the node's CPUs and memory from this file, not from the machine.
SlurmdParameters=config_overrides
# Timeouts and waits for one short job on one machine.
SlurmdTimeout=60
SlurmctldTimeout=60
InactiveLimit=0
KillWait=5
MinJobAge=10
MessageTimeout=20
MailProg=/bin/true

NodeName=$NODE NodeAddr=127.0.0.1 NodeHostname=$NODE CPUs=$CPUS RealMemory=1000 State=UNKNOWN
PartitionName=debug Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
EOF

# ---- the daemons -------------------------------------------------------------------------
slurmctld -D -c -i -f "$SLURM_CONF" >>"$WORK/log/slurmctld.out" 2>&1 &
SLURMCTLD_PID=$!
slurmd -D -N "$NODE" -f "$SLURM_CONF" >>"$WORK/log/slurmd.out" 2>&1 &
SLURMD_PID=$!

# Wait for the node to be idle: up to 60 s, resuming it if it comes up down or drained.
state=""
for i in $(seq 1 120); do
  for pid in "$SLURMCTLD_PID" "$SLURMD_PID" "$MUNGED_PID"; do
    kill -0 "$pid" 2>/dev/null || { echo "slurm.sh: a daemon exited at start (pid $pid)" >&2; exit 1; }
  done
  state=$(sinfo -h -n "$NODE" -o %t 2>/dev/null | head -n 1 || true)
  case "$state" in
    idle) break ;;
    down* | drain* | drng* | fail*)
      if [ $((i % 4)) = 0 ]; then
        scontrol update nodename="$NODE" state=resume >/dev/null 2>&1 || true
      fi
      ;;
  esac
  sleep 0.5
done
if [ "$state" != idle ]; then
  echo "slurm.sh: node $NODE is not idle after 60 s (state '${state:-none}')" >&2
  sinfo -N -l >&2 2>&1 || true
  exit 1
fi

# ---- the step ----------------------------------------------------------------------------
# `timeout` backs up --time=5 (minutes) should the step never start; srun cancels the job when
# it gets SIGTERM. srun runs in the background and the script waits for it, so that a SIGTERM or
# SIGINT to the script runs the cleanup at once rather than when srun ends. (Its stdin is
# /dev/null, as for any background command; the tasks' stdout/stderr are the script's.)
# srun's exit code is the largest of the tasks' exit codes (or 128 + signal).
timeout --kill-after=20 420 srun --overcommit -N"$NODES" -n "$TASKS" --time=5 \
  --kill-on-bad-exit=1 --export=ALL "$@" &
SRUN_PID=$!
SRUN_STATUS=0
wait "$SRUN_PID" || SRUN_STATUS=$?
SRUN_PID=""
exit "$SRUN_STATUS"
