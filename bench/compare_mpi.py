#!/usr/bin/env python3
"""nexar-bench against OpenMPI (TCP, or with --btl vader its shared memory), alternated in one sitting.

Each round runs the OpenMPI baseline (TCP BTL over loopback, np 2; nexar then runs with
NEXAR_SHM=off, over the network too) and then the same operations with nexar-bench, so both see
the same machine load; after all rounds it prints, per
row, the median and range of each side, the ratio of the medians (above 1 is nexar ahead:
busbw divided by busbw, or time divided by time for latencies) and, in brackets, the median
and range of the rounds' own ratios (each round's nexar run against the OpenMPI run of the
same round: paired, so that the machine's drift from round to round cancels, which on a
shared machine moves both sides by a third or more).

    bench/compare_mpi.py --rounds 5
    bench/compare_mpi.py --rounds 5 --btl vader --shm-off   # same-host transports

Needs `target/release/nexar-bench` (`cargo build --release -p nexar --features cli --bin nexar-bench`) and the
baseline binary that `../shared/bench/baselines/run_mpi.sh` builds (`/tmp/baselines-build/
mpi_allreduce`, with OpenMPI installed); `--build-mpi` runs that script once first.
"""

import argparse
import atexit
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
BASELINES = os.path.join(ROOT, "..", "shared", "bench", "baselines")

def mpi_run(btl):
    """The mpirun command line for OpenMPI's `tcp` or `vader` (shared memory) transport."""
    return [
        "mpirun", "--allow-run-as-root", "--oversubscribe",
        "--mca", "oob_tcp_if_include", "lo", "--mca", "btl_tcp_if_include", "lo",
        "--mca", "pml", "ob1", "--mca", "btl", f"{btl},self", "-np", "2",
    ]


# OpenMPI over TCP (what bench/busy.py runs).
MPI_RUN = mpi_run("tcp")


def compile_mpi(source):
    """`bench/<source>.c` compiled with mpicc into a scratch directory removed at exit: the path."""
    scratch = tempfile.mkdtemp()
    atexit.register(shutil.rmtree, scratch, ignore_errors=True)
    binary = os.path.join(scratch, source)
    subprocess.run(["mpicc", "-O3", "-o", binary, os.path.join(ROOT, "bench", f"{source}.c")], check=True)
    return binary

# (row name, MPI output label, nexar-bench arguments, bytes of the nexar row, unit)
ROWS = [
    ("allreduce 4 KiB", "allreduce 4KiB", ["-b", "4K", "-e", "4K", "-n", "500", "-w", "50"], 4096, "us"),
    ("allreduce 64 KiB", "allreduce 64KiB", ["-b", "64K", "-e", "64K", "-n", "300", "-w", "30"], 64 << 10, "us"),
    ("allreduce 1 MiB", "allreduce 1MiB", ["-b", "1M", "-e", "1M", "-n", "50", "-w", "5"], 1 << 20, "GB/s"),
    ("allreduce 16 MiB", "allreduce 16MiB", ["-b", "16M", "-e", "16M", "-n", "20", "-w", "5"], 16 << 20, "GB/s"),
    ("allreduce 64 MiB", "allreduce 64MiB", ["-b", "64M", "-e", "64M", "-n", "10", "-w", "3"], 64 << 20, "GB/s"),
    ("broadcast 1 MiB", "bcast 1MiB", ["--op", "broadcast", "-b", "1M", "-e", "1M", "-n", "50", "-w", "5"], 1 << 20, "GB/s"),
    ("broadcast 64 MiB", "bcast 64MiB", ["--op", "broadcast", "-b", "64M", "-e", "64M", "-n", "10", "-w", "3"], 64 << 20, "GB/s"),
    ("barrier", "barrier -", ["--op", "barrier", "-n", "2000", "-w", "50"], 0, "us"),
]


def mpi_round(binary, btl):
    """One OpenMPI run: {label: (time_us, busbw)}."""
    out = subprocess.run(mpi_run(btl) + [binary], capture_output=True, text=True, check=True).stdout
    found = {}
    for line in out.splitlines():
        m = re.match(r"^(\w+)\s+(\S+)\s+([\d.]+)\s+([\d.]+|-)\s+([\d.]+|-)", line)
        if m:
            busbw = float(m.group(5)) if m.group(5) != "-" else None
            found[f"{m.group(1)} {m.group(2)}"] = (float(m.group(3)), busbw)
    return found


def nexar_row(binary, args, nbytes, env=None):
    """One nexar-bench run of one size: (time_us, busbw)."""
    env = dict(os.environ, **(env or {}))
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        subprocess.run([binary, "--np", "2", "--json", f.name] + args, capture_output=True, text=True, check=True, env=env)
        rows = json.load(open(f.name))
    row = next(r for r in rows if r["bytes"] == nbytes)
    if row["wrong"]:
        sys.exit(f"nexar-bench reported {row['wrong']} wrong elements for {args}")
    return row["time_us"], row["busbw_gbps"]


def fmt(values, unit):
    med = statistics.median(values)
    digits = 1 if unit == "us" else 2
    return f"{med:.{digits}f} ({min(values):.{digits}f}–{max(values):.{digits}f})"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--nexar", default=os.path.join(ROOT, "target", "release", "nexar-bench"))
    p.add_argument("--mpi", default="/tmp/baselines-build/mpi_allreduce")
    p.add_argument("--build-mpi", action="store_true", help="run the baseline script once to build the MPI binary")
    p.add_argument("--plaintext", action="store_true",
                   help="also run nexar with NEXAR_BULK_ENCRYPTION=off in each round (trusted fabrics only)")
    p.add_argument("--aes-gcm", action="store_true",
                   help="also run nexar with NEXAR_LANE_CIPHER=aes-128-gcm in each round (the default is AEGIS-128X2)")
    p.add_argument("--btl", choices=["tcp", "vader"], default="tcp",
                   help="OpenMPI's transport: tcp (loopback) or vader (shared memory)")
    p.add_argument("--shm-off", action="store_true",
                   help="also run nexar with NEXAR_SHM=off in each round (its network path between same-host ranks)")
    a = p.parse_args()
    if a.build_mpi:
        results = tempfile.mkdtemp()
        atexit.register(shutil.rmtree, results, ignore_errors=True)
        env = dict(os.environ, REPS="1", NPS="2", RESULTS=results)
        subprocess.run(["bash", os.path.join(BASELINES, "run_mpi.sh")], env=env, check=True, capture_output=True)
    for path in (a.nexar, a.mpi):
        if not os.path.exists(path):
            sys.exit(f"{path} is missing (see this script's help)")
    # Against OpenMPI forced onto TCP, nexar too uses the network (its shared memory is the
    # counterpart of OpenMPI's vader).
    network = {"NEXAR_SHM": "off"} if a.btl == "tcp" else {}
    sides = [("nexar", network)]
    if a.aes_gcm:
        sides.append(("nexar aes-gcm", dict(network, NEXAR_LANE_CIPHER="aes-128-gcm")))
    if a.plaintext:
        sides.append(("nexar plaintext", dict(network, NEXAR_BULK_ENCRYPTION="off")))
    if a.shm_off and a.btl == "vader":
        sides.append(("nexar shm off", {"NEXAR_SHM": "off"}))
    mpi = {name: [] for name, *_ in ROWS}
    nexar = {side: {name: [] for name, *_ in ROWS} for side, _ in sides}
    for r in range(a.rounds):
        found = mpi_round(a.mpi, a.btl)
        for name, label, args, nbytes, unit in ROWS:
            t, bw = found[label]
            mpi[name].append(t if unit == "us" else bw)
            for side, env in sides:
                t, bw = nexar_row(a.nexar, args, nbytes, env)
                nexar[side][name].append(t if unit == "us" else bw)
        print(f"# round {r + 1}/{a.rounds} done", file=sys.stderr)
    print(f"# {a.rounds} alternating rounds, np 2, loopback, OpenMPI {a.btl}; median (min–max); ratio > 1: nexar ahead "
          "(of the medians; then [the median, min–max of the rounds' own ratios]: each round's nexar run against "
          "that round's OpenMPI run, so that the machine's drift between rounds cancels)")
    head = "".join(f" {side:<22} |" for side, _ in sides) + f" {'OpenMPI ' + a.btl:<22} |" + "".join(
        f" ratio{'' if side == 'nexar' else ' (' + side[6:] + ')'} [rounds] |" for side, _ in sides)
    print(f"| {'operation':<18} | unit |{head}")
    print(f"|{'-' * 20}|------|" + f"{'-' * 24}|" * (len(sides) + 1) + "-----------------------------|" * len(sides))
    for name, _, _, _, unit in ROWS:
        m = statistics.median(mpi[name])
        cells = "".join(f" {fmt(nexar[side][name], unit):<22} |" for side, _ in sides)
        ratios = ""
        for side, _ in sides:
            n = statistics.median(nexar[side][name])
            paired = [(mr / nr if unit == "us" else nr / mr) for mr, nr in zip(mpi[name], nexar[side][name])]
            ratios += f" {(m / n if unit == 'us' else n / m):.2f} [{statistics.median(paired):.2f}, {min(paired):.2f}–{max(paired):.2f}] |"
        print(f"| {name:<18} | {unit:<4} |{cells} {fmt(mpi[name], unit):<22} |{ratios}")


if __name__ == "__main__":
    main()
