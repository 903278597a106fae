#!/usr/bin/env python3
"""nexar at 2 to 128 rank processes on this machine, beside OpenMPI (`mpirun --oversubscribe`).

For each N, nexar (`nexar launch -n N nexar/examples/scale.rs`) and OpenMPI
(`mpirun --oversubscribe -n N bench/mpi_scale.c`, shared memory between the ranks as its
default) run one after the other, `--rounds` times, quiet or with a niced busy loop on every
core (`--load`). Each rank prints one JSON line (see the two programs); a row gives, as the
median over rounds:
  - the job's wall time (launch to exit) and whether every rank succeeded (ok/runs);
  - the time to form (process start to `init()` / `MPI_Init` returning, median over ranks);
  - the first allreduce (1 Mi f64; nexar brings its links' back ends up in it);
  - a steady 4 KiB allreduce (median and p99 over 200 iterations of the slowest rank);
  - PSS per rank (median over ranks, MiB);
  - nexar's liveness messages per second per rank while idle (median over ranks; OpenMPI
    sends none of its own), and ranks declared dead (any is a false death: nothing is killed).

    cargo build --release -p nexar --features cli --bin nexar --example scale
    mpicc -O2 -o /tmp/mpi_scale bench/mpi_scale.c    # Debian: libopenmpi-dev
    bench/scale.py --ns 2 4 8 16 32 64 128 --rounds 3
    bench/scale.py --ns 64 --rounds 20 --load --nexar-only   # the false-death count
    bench/scale.py --ns 64 --rounds 5 --kill                 # kill -9 of one rank of 64

With `--kill`, nexar only: under `nexar launch --on-failure continue`, rank N/3 is killed with
SIGKILL after the steady phase; a row gives the time from the kill until the survivors'
allreduce failed naming it (median and slowest survivor) and until their `recover()` returned,
and whether every survivor recovered and checked an allreduce on the rebuilt communicator.

Prints a Markdown table per load.
"""

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(cmd, env, timeout):
    start = time.monotonic()
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        ok, out, err = p.returncode == 0, p.stdout, p.stderr
    except subprocess.TimeoutExpired as e:
        ok, out, err = False, (e.stdout or b"").decode(errors="replace"), "timed out"
    wall = time.monotonic() - start
    rows = []
    for line in out.splitlines():
        line = line[line.find("{"):] if "{" in line else ""
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return {"ok": ok, "wall": wall, "rows": rows, "err": err[-2000:]}


def kill_run(cmd, env, n, timeout):
    """Runs `cmd`, kills the rank that prints its pid 1 s after it does, and measures the rest."""
    victim = n // 3
    env = dict(env, SCALE_KILL_RANK=str(victim))
    start = time.monotonic()
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    killed_at, rows = None, []
    try:
        for line in p.stdout:
            line = line[line.find("{"):] if "{" in line else ""
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if "victim_pid" in row and killed_at is None:
                time.sleep(1.0)
                os.kill(row["victim_pid"], signal.SIGKILL)
                killed_at = time.time()
            elif "failed_at" in row:
                rows.append(row)
            if time.monotonic() - start > timeout:
                break
        p.wait(timeout=max(1, timeout - (time.monotonic() - start)))
    except subprocess.TimeoutExpired:
        pass
    finally:
        if p.poll() is None:
            p.kill()
    err = p.stderr.read()[-2000:] if p.stderr else ""
    if killed_at is None or not rows:
        return {"ok": False, "survivors": len(rows), "err": err}
    detect = sorted(r["failed_at"] - killed_at for r in rows)
    recover = sorted(r["recovered_at"] - killed_at for r in rows)
    return {
        "ok": len(rows) == n - 1 and all(r["world_after"] == n - 1 for r in rows),
        "survivors": len(rows),
        "detect_p50": statistics.median(detect),
        "detect_max": detect[-1],
        "recover_p50": statistics.median(recover),
        "recover_max": recover[-1],
        "wall": time.monotonic() - start,
        "err": err if len(rows) != n - 1 else "",
    }


def kill_table(args, nexar, scale, env):
    table = {}
    for n in args.ns:
        for rnd in range(args.rounds):
            cmd = [nexar, "launch", "--on-failure", "continue", "-n", str(n), scale]
            s = kill_run(cmd, env, n, args.timeout)
            table.setdefault(n, []).append(s)
            print(f"n={n} kill round {rnd + 1}: {json.dumps(s)}", file=sys.stderr, flush=True)
    print(f"\n### kill -9 of rank N/3, {'with a niced busy loop on every core' if args.load else 'quiet'} ({args.rounds} rounds)\n")
    print("| N | all survivors recovered | kill → allreduce failed, median / slowest (s) | kill → recovered, median / slowest (s) |")
    print("|---|---|---|---|")
    for n, runs in table.items():
        good = [r for r in runs if "detect_p50" in r]
        ok = sum(r["ok"] for r in runs)
        m = lambda k: statistics.median(r[k] for r in good) if good else float("nan")
        print(f"| {n} | {ok}/{len(runs)} | {m('detect_p50'):.2f} / {m('detect_max'):.2f} | {m('recover_p50'):.2f} / {m('recover_max'):.2f} |")


def summary(result, n):
    rows = result["rows"]
    med = lambda k: statistics.median(r[k] for r in rows) if rows else float("nan")
    return {
        "ok": result["ok"] and len(rows) == n,
        "wall": result["wall"],
        "form": med("form_s"),
        "first": med("first_allreduce_s"),
        "p50": med("steady_4k_median_us"),
        "p99": med("steady_4k_p99_us"),
        "pss": med("pss_kib") / 1024,
        "live": med("liveness_per_s"),
        "dead": max((r["dead"] for r in rows), default=0),
    }


def busy_load():
    """A niced busy loop on every core; returns the processes."""
    return [subprocess.Popen(["nice", "-n", "19", sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 2)]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ns", type=int, nargs="+", default=[2, 4, 8, 16, 32, 64, 128])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--load", action="store_true", help="a niced busy loop on every core")
    ap.add_argument("--nexar-only", action="store_true")
    ap.add_argument("--mpi", default="/tmp/mpi_scale")
    ap.add_argument("--timeout", type=int, default=600)
    ap.add_argument("--kill", action="store_true", help="kill -9 one rank and time detection and recovery")
    args = ap.parse_args()
    nexar = os.path.join(ROOT, "target/release/nexar")
    scale = os.path.join(ROOT, "target/release/examples/scale")
    env = dict(os.environ, NEXAR_LOG=os.environ.get("NEXAR_LOG", "error"))
    load = busy_load() if args.load else []
    if args.kill:
        try:
            kill_table(args, nexar, scale, env)
        finally:
            for p in load:
                p.kill()
        return
    table = {}
    try:
        for n in args.ns:
            for rnd in range(args.rounds):
                sides = [("nexar", [nexar, "launch", "-n", str(n), scale])]
                if not args.nexar_only:
                    sides.append(("mpi", ["mpirun", "--allow-run-as-root", "--oversubscribe", "-n", str(n), args.mpi]))
                if rnd % 2:
                    sides.reverse()
                for side, cmd in sides:
                    s = summary(run(cmd, env, args.timeout), n)
                    table.setdefault((n, side), []).append(s)
                    print(f"n={n} {side} round {rnd + 1}: {json.dumps(s)}", file=sys.stderr, flush=True)
    finally:
        for p in load:
            p.kill()
    print(f"\n### {'with a niced busy loop on every core' if args.load else 'quiet'} ({args.rounds} rounds, medians)\n")
    print("| N | side | ok | wall (s) | form (s) | first allreduce 1 Mi f64 (s) | 4 KiB allreduce p50 / p99 (µs) | PSS per rank (MiB) | liveness msgs/s per rank | ranks declared dead |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for (n, side), runs in table.items():
        ok = sum(r["ok"] for r in runs)
        m = lambda k: statistics.median(r[k] for r in runs)
        print(f"| {n} | {side} | {ok}/{len(runs)} | {m('wall'):.1f} | {m('form'):.2f} | {m('first'):.3f} | "
              f"{m('p50'):.0f} / {m('p99'):.0f} | {m('pss'):.1f} | {m('live'):.1f} | {max(r['dead'] for r in runs)} |")


if __name__ == "__main__":
    main()
