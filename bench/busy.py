#!/usr/bin/env python3
"""Small-message latency on a quiet and on a busy machine: nexar-bench against OpenMPI-TCP.

A training job always has other work on its cores. This script runs, for each background load
in turn (none; a niced `cargo build`; a niced memory-bound copy on every core; optionally a
niced busy loop on every core), several
alternating rounds of:
  - OpenMPI over TCP (np 2, loopback; mpirun binds each rank to a core by default), with
    `bench/mpi_latency.c`, which times each iteration as nexar-bench -I does;
  - nexar-bench with each rank bound to a core (its default, as mpirun does);
  - nexar-bench with placement left to the kernel (`--bind-to none`), which is what a program
    started by a launcher that does not bind sees;
  - optionally (`--sides`): nexar with shared memory between the ranks (its default on one
    host), bound or unbound (`unbound-shm`: what ranks that torchrun starts on one host get),
    and nexar bound under `chrt -f 1` (SCHED_FIFO; needs root or CAP_SYS_NICE), which
    shows how much of the tail is the wait of a woken normal thread for its core;
and prints, per load and side, the median over runs of each run's p50 and p99 for a 4 KiB
allreduce and a barrier, plus the share of iterations over 10x the run's median.

    bench/busy.py --rounds 5
    bench/busy.py --rounds 3 --loads quiet,build,spin
    bench/busy.py --rounds 3 --sides mpi,bound,bound-fifo,bound-shm

Needs `target/release/nexar-bench` and OpenMPI (`mpicc`, `mpirun`); the script compiles
`bench/mpi_latency.c` itself. The build load compiles nexar into its own target directory
(`/tmp/nexar-busy-target`, removed afterwards); the memory load is `dd` from /dev/zero to
/dev/null in 32 MiB blocks, one per core; the spin load is a shell busy loop per core. All run
at `nice -n 15`, each in a session of its own, so with the kernel's autogroups (most
distributions') the nice value weighs only within the load: across sessions it competes as
an equal.
"""

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from compare_mpi import MPI_RUN, ROOT, compile_mpi

BUILD_TARGET = "/tmp/nexar-busy-target"

ITERS = 1000

# (row name, mpi_latency's label, nexar-bench arguments)
ROWS = [
    ("allreduce 4 KiB", "allreduce_4KiB", ["-b", "4K", "-e", "4K", "-n", str(ITERS), "-w", "50"]),
    ("barrier", "barrier", ["--op", "barrier", "-n", str(ITERS), "-w", "50"]),
]


def mpi_run(binary):
    """One OpenMPI run: {label: (p50, p99, share over 10x)}."""
    out = subprocess.run(MPI_RUN + [binary, str(ITERS)], capture_output=True, text=True, check=True).stdout
    found = {}
    for line in out.splitlines():
        words = line.split()
        if len(words) == 9:
            found[words[0]] = (float(words[2]), float(words[4]), float(words[8]))
    return found


class Load:
    """A background load, started and stopped with the `with` statement."""

    def __init__(self, kind):
        self.kind, self.procs = kind, []

    def __enter__(self):
        cores = os.cpu_count() or 1
        if self.kind == "build":
            # Rebuilds for as long as the load is wanted.
            script = (
                f"while :; do cargo build --release -p nexar --features cli --target-dir {BUILD_TARGET} >/dev/null 2>&1; "
                f"cargo clean -p nexar --release --target-dir {BUILD_TARGET} >/dev/null 2>&1; done"
            )
            self.procs.append(subprocess.Popen(["nice", "-n", "15", "bash", "-c", script], cwd=ROOT, start_new_session=True))
            time.sleep(20)  # past dependency resolution, into compilation
        elif self.kind == "memory":
            for _ in range(cores):
                self.procs.append(subprocess.Popen(
                    ["nice", "-n", "15", "dd", "if=/dev/zero", "of=/dev/null", "bs=32M"],
                    stderr=subprocess.DEVNULL, start_new_session=True))
            time.sleep(1)
        elif self.kind == "spin":
            # Work that never sleeps, one busy loop per core (a data loader, another job).
            for _ in range(cores):
                self.procs.append(subprocess.Popen(
                    ["nice", "-n", "15", "sh", "-c", "while :; do :; done"], start_new_session=True))
            time.sleep(1)
        elif self.kind != "quiet":
            sys.exit(f"unknown load {self.kind!r}")
        return self

    def __exit__(self, *exc):
        for p in self.procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
        if self.kind == "build":
            shutil.rmtree(BUILD_TARGET, ignore_errors=True)


# The nexar sides: (key, name, --bind-to, extra environment, command prefix).
NEXAR_SIDES = [
    ("bound", "nexar, bound", "core", {}, []),
    ("unbound", "nexar, unbound", "none", {}, []),
    # Shared memory between the two ranks (nexar's default on one host; OpenMPI-TCP has none).
    ("bound-shm", "nexar shm, bound", "core", {"NEXAR_SHM": "on"}, []),
    # Unbound with shared memory: what ranks started by torchrun on one host get by default.
    ("unbound-shm", "nexar shm, unbound", "none", {"NEXAR_SHM": "on"}, []),
    # Real-time policy: a woken rank takes its core from a normal thread at once.
    ("bound-fifo", "nexar, bound, SCHED_FIFO", "core", {}, ["chrt", "-f", "1"]),
]


def nexar_run(binary, args, bind, extra, prefix):
    """One nexar-bench run: (p50, p99, share over 10x) in microseconds and percent."""
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        # Over the network, as OpenMPI here (NEXAR_SHM=off: no shared memory between the ranks),
        # unless the side says otherwise.
        subprocess.run(prefix + [binary, "--np", "2", "-I", "--bind-to", bind, "--json", f.name] + args,
                       capture_output=True, text=True, check=True, env={**os.environ, "NEXAR_SHM": "off", **extra})
        row = json.load(open(f.name))[0]
    if row["wrong"]:
        sys.exit(f"nexar-bench reported {row['wrong']} wrong elements for {args}")
    return row["p50_us"], row["p99_us"], 100.0 * row["over_10x"]


def med(values, digits=1):
    return f"{statistics.median(values):.{digits}f}" if values else "-"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--loads", default="quiet,build,memory")
    p.add_argument("--nexar", default=os.path.join(ROOT, "target", "release", "nexar-bench"))
    p.add_argument("--sides", default="mpi,bound,unbound",
                   help="which sides to run, comma-separated")
    a = p.parse_args()
    if not os.path.exists(a.nexar):
        sys.exit(f"{a.nexar} is missing (cargo build --release -p nexar --features cli --bin nexar-bench)")
    mpi = compile_mpi("mpi_latency")
    keys = {"mpi": "OpenMPI-TCP", **{key: name for key, name, *_ in NEXAR_SIDES}}
    unknown = [k for k in a.sides.split(",") if k not in keys]
    if unknown:
        sys.exit(f"unknown sides {unknown}; the sides are {list(keys)}")
    sides = [keys[k] for k in a.sides.split(",")]
    print(f"# {a.rounds} alternating rounds per load, np 2, loopback, {ITERS} iterations a run; medians over")
    print("# runs of each run's p50 / p99 (us) and of its share of iterations over 10x its median")
    print(f"| load | operation | {' | '.join(sides)} |")
    print(f"|---|---|{'---|' * len(sides)}")
    for kind in a.loads.split(","):
        got = {(row, side): [] for row, *_ in ROWS for side in sides}
        with Load(kind):
            for r in range(a.rounds):
                found = mpi_run(mpi) if "OpenMPI-TCP" in sides else {}
                for name, label, args in ROWS:
                    if found:
                        got[(name, "OpenMPI-TCP")].append(found[label])
                    for _, side, bind, extra, prefix in NEXAR_SIDES:
                        if side in sides:
                            got[(name, side)].append(nexar_run(a.nexar, args, bind, extra, prefix))
                print(f"# {kind}: round {r + 1}/{a.rounds} done", file=sys.stderr)
        for name, *_ in ROWS:
            cells = []
            for side in sides:
                runs = got[(name, side)]
                p50, p99, over = ([x[i] for x in runs] for i in range(3))
                cells.append(f"p50 {med(p50)} / p99 {med(p99)} / >10x {med(over, 2)} %")
            print(f"| {kind} | {name} | {' | '.join(cells)} |", flush=True)


if __name__ == "__main__":
    main()
