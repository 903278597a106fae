#!/usr/bin/env python3
"""A fused plan against 100 separate allreduces, nexar beside OpenMPI, alternated in one sitting.

Each round runs `bench/mpi_fusion.c` under mpirun (one `MPI_Allreduce` of 1,000,000 floats,
then 100 of 10,000, np 2 over loopback; with `--vader` also over OpenMPI's shared memory) and
then `nexar-bench --op plan` (the same 100 buffers of 10,000 f32 as one fused plan, then as
100 separate calls) over each of nexar's paths: the TCP lane sealed (`NEXAR_SHM=off`, the
default between hosts; with AEGIS-128X2, the default, and with AES-128-GCM), the TCP lane in plaintext (`NEXAR_BULK_ENCRYPTION=off`, trusted fabrics
only) and shared memory (the default between ranks of one host). It prints, per side, the
fused and separate times (median and range over the rounds, µs), the gain from fusing
(separate over fused, per round, median and range), and, paired round by round with OpenMPI
TCP's run of the same round (so that the machine's drift between rounds cancels), OpenMPI's
fused time over the side's and the side's gain over OpenMPI's: the README's "Fused plans"
table.

    bench/compare_plan.py --rounds 3
    bench/compare_plan.py --rounds 5 --vader

Needs `target/release/nexar-bench` (`cargo build --release -p nexar --features cli --bin
nexar-bench`) and OpenMPI (`mpicc`, `mpirun`); the script compiles `bench/mpi_fusion.c` itself.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compare_mpi import ROOT, compile_mpi, mpi_run  # noqa: E402

NEXAR_SIDES = [
    ("nexar, TCP lane (`NEXAR_SHM=off`), AEGIS-128X2", {"NEXAR_SHM": "off"}),
    ("nexar, TCP lane, AES-128-GCM", {"NEXAR_SHM": "off", "NEXAR_LANE_CIPHER": "aes-128-gcm"}),
    ("nexar, TCP lane, plaintext", {"NEXAR_SHM": "off", "NEXAR_BULK_ENCRYPTION": "off"}),
    ("nexar, shared memory (default on one host)", {}),
]


def mpi_plan(binary, btl):
    """One run of mpi_fusion: (fused_us, separate_us)."""
    out = subprocess.run(mpi_run(btl) + [binary], capture_output=True, text=True, check=True).stdout
    m = re.search(r"fused ([\d.]+) us, separate ([\d.]+) us", out)
    if not m:
        sys.exit(f"mpi_fusion printed no result:\n{out}")
    return float(m.group(1)), float(m.group(2))


def nexar_plan(binary, iters, env):
    """One run of `nexar-bench --op plan`: (fused_us, separate_us)."""
    env = dict(os.environ, **env)
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        args = [binary, "--op", "plan", "--np", "2", "-n", str(iters), "-w", "5", "--json", f.name]
        subprocess.run(args, capture_output=True, text=True, check=True, env=env)
        rows = json.load(open(f.name))
    if len(rows) != 2:
        sys.exit(f"nexar-bench --op plan wrote {len(rows)} rows, not fused and separate")
    if any(r["wrong"] for r in rows):
        sys.exit(f"nexar-bench --op plan reported wrong elements with {env}")
    return rows[0]["time_us"], rows[1]["time_us"]


def spread(values, digits=0, unit=""):
    med = statistics.median(values)
    return f"{med:,.{digits}f}{unit} ({min(values):,.{digits}f}–{max(values):,.{digits}f})"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iters", type=int, default=40, help="nexar-bench iterations per mode (mpi_fusion runs 50)")
    p.add_argument("--nexar", default=os.path.join(ROOT, "target", "release", "nexar-bench"))
    p.add_argument("--vader", action="store_true", help="also run mpi_fusion over OpenMPI's shared memory")
    a = p.parse_args()
    if not os.path.exists(a.nexar):
        sys.exit(f"{a.nexar} is missing (see this script's help)")
    mpi = compile_mpi("mpi_fusion")
    sides = [("OpenMPI TCP", ("mpi", "tcp"))]
    if a.vader:
        sides.append(("OpenMPI vader", ("mpi", "vader")))
    sides += [(name, ("nexar", env)) for name, env in NEXAR_SIDES]
    runs = {name: [] for name, _ in sides}
    for r in range(a.rounds):
        for name, (kind, how) in sides:
            runs[name].append(mpi_plan(mpi, how) if kind == "mpi" else nexar_plan(a.nexar, a.iters, how))
        print(f"# round {r + 1}/{a.rounds} done", file=sys.stderr)
    print(f"# {a.rounds} alternating rounds, np 2, loopback; 100 allreduces of 10,000 f32 fused into one and "
          "separate; median (min–max) over the rounds; gain = separate / fused, per round; the last two columns "
          "pair each round with OpenMPI TCP's run of that round (drift between rounds cancels): OpenMPI's fused "
          "time over this side's (above 1: this side faster) and this side's gain over OpenMPI's (at or above 1: "
          "fusing pays at least as much here)")
    print("| | fused | separate | gain | fused, paired (OpenMPI / this) | gain, paired (this / OpenMPI) |")
    print("|---|---|---|---|---|---|")
    reference = runs["OpenMPI TCP"]
    for name, _ in sides:
        fused = [f for f, _ in runs[name]]
        separate = [s for _, s in runs[name]]
        gains = [s / f for f, s in runs[name]]
        paired_fused = [mf / f for (mf, _), (f, _) in zip(reference, runs[name])]
        paired_gain = [(s / f) / (ms / mf) for (mf, ms), (f, s) in zip(reference, runs[name])]
        print(f"| {name} | {spread(fused, unit=' µs')} | {spread(separate, unit=' µs')} | {spread(gains, 2, '×')} "
              f"| {spread(paired_fused, 2)} | {spread(paired_gain, 2)} |")

if __name__ == "__main__":
    main()
