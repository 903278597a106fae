#!/usr/bin/env python3
"""Point-to-point: nexar-bench's `sendrecv` and `pingpong` against OpenMPI's, alternated in one sitting.

Each round runs `bench/mpi_p2p.c` under OpenMPI (np 2, TCP over loopback, or with --btl vader
its shared memory) and then nexar-bench with the same shapes, on each side asked for, so all
see the same machine load. After all rounds it prints, per operation and size, the median
(min–max) time in µs of each side and OpenMPI's time over each nexar side's (above 1: nexar
ahead).

Sides (`--sides`, comma-separated):
  lane   nexar with NEXAR_SHM=off: between hosts' worth of network path, the TCP lane (default);
  quic   the same with NEXAR_BULK_TRANSPORT=quic (everything over QUIC);
  plain  the lane in plaintext, NEXAR_BULK_ENCRYPTION=off (trusted fabrics only);
  shm    nexar as it runs on one host by default (shared memory), for --btl vader.

    bench/compare_p2p.py --rounds 3                         # lane and quic against OpenMPI-TCP
    bench/compare_p2p.py --rounds 3 --btl vader --sides shm

Needs `target/release/nexar-bench` (`cargo build --release -p nexar --features cli --bin
nexar-bench`) and OpenMPI's `mpicc` and `mpirun` (the baseline is built on the first run).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from compare_mpi import ROOT, mpi_run

HERE = os.path.dirname(os.path.abspath(__file__))
SIZES = [8] + [4096 << (2 * k) for k in range(8)]  # 8 B, then 4 KiB to 64 MiB by 4
OPS = ["sendrecv", "pingpong"]
SIDES = {
    "lane": {"NEXAR_SHM": "off"},
    "quic": {"NEXAR_SHM": "off", "NEXAR_BULK_TRANSPORT": "quic"},
    "plain": {"NEXAR_SHM": "off", "NEXAR_BULK_ENCRYPTION": "off"},
    "shm": {},
}
# nexar-bench runs per operation: (arguments, iterations): many for small sizes, fewer for large.
RUNS = [(["-b", "8", "-e", "8"], 1000, 100), (["-b", "4K", "-e", "64K", "-f", "4"], 500, 50),
        (["-b", "256K", "-e", "64M", "-f", "4"], 20, 3)]


def build_mpi(out):
    if not os.path.exists(out):
        subprocess.run(["mpicc", "-O3", "-o", out, os.path.join(HERE, "mpi_p2p.c")], check=True)


def mpi_round(binary, btl):
    """{(op, bytes): time_us} from one OpenMPI run."""
    out = subprocess.run(mpi_run(btl) + [binary], capture_output=True, text=True, check=True).stdout
    found = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[0] in OPS:
            found[(parts[0], int(parts[1]))] = float(parts[2])
    return found


def nexar_round(binary, env):
    """{(op, bytes): time_us} from nexar-bench runs of both operations at every size."""
    env = dict(os.environ, **env)
    found = {}
    for op in OPS:
        for args, iters, warmup in RUNS:
            with tempfile.NamedTemporaryFile(suffix=".json") as f:
                cmd = [binary, "--np", "2", "--op", op, "-n", str(iters), "-w", str(warmup), "--json", f.name] + args
                subprocess.run(cmd, capture_output=True, text=True, check=True, env=env)
                for row in json.load(open(f.name)):
                    if row["wrong"]:
                        sys.exit(f"nexar-bench reported {row['wrong']} wrong elements: {' '.join(cmd)}")
                    found[(op, row["bytes"])] = row["time_us"]
    return found


def size_name(n):
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB" if n >= 1024 else f"{n} B"


def fmt(values):
    med = statistics.median(values)
    digits = 1 if med < 1000 else 0
    return f"{med:,.{digits}f} ({min(values):,.{digits}f}–{max(values):,.{digits}f})"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--nexar", default=os.path.join(ROOT, "target", "release", "nexar-bench"))
    p.add_argument("--mpi", default="/tmp/baselines-build/mpi_p2p")
    p.add_argument("--btl", choices=["tcp", "vader"], default="tcp")
    p.add_argument("--sides", default="lane,quic")
    a = p.parse_args()
    sides = a.sides.split(",")
    for side in sides:
        if side not in SIDES:
            sys.exit(f"unknown side {side}: one of {', '.join(SIDES)}")
    if not os.path.exists(a.nexar):
        sys.exit(f"{a.nexar} is missing (see this script's help)")
    os.makedirs(os.path.dirname(a.mpi), exist_ok=True)
    build_mpi(a.mpi)
    keys = [(op, n) for op in OPS for n in SIZES]
    mpi = {k: [] for k in keys}
    nexar = {side: {k: [] for k in keys} for side in sides}
    for r in range(a.rounds):
        found = mpi_round(a.mpi, a.btl)
        for k in keys:
            mpi[k].append(found[k])
        for side in sides:
            found = nexar_round(a.nexar, SIDES[side])
            for k in keys:
                nexar[side][k].append(found[k])
        print(f"# round {r + 1}/{a.rounds} done", file=sys.stderr)
    print(f"# {a.rounds} alternating rounds, np 2, loopback, OpenMPI {a.btl}; µs, median (min–max); "
          "ratio: OpenMPI's time over nexar's (> 1: nexar ahead)")
    head = "".join(f" nexar {side} |" for side in sides)
    print(f"| operation | size |{head} OpenMPI {a.btl} |" + "".join(f" ratio ({side}) |" for side in sides))
    print("|---|---|" + "---|" * (2 * len(sides) + 1))
    for op, n in keys:
        m = statistics.median(mpi[(op, n)])
        cells = "".join(f" {fmt(nexar[side][(op, n)])} |" for side in sides)
        ratios = "".join(f" {m / statistics.median(nexar[side][(op, n)]):.2f} |" for side in sides)
        print(f"| {op} | {size_name(n)} |{cells} {fmt(mpi[(op, n)])} |{ratios}")


if __name__ == "__main__":
    main()
