#!/usr/bin/env python3
"""nexar-candle's DDP against PyTorch DDP (Gloo, CPU) at np 2, alternated in one sitting.

The model is an MLP of `--layers` Linear layers of `--width` (25 × 1000 by default: 50
parameter tensors, 25.0 M parameters, 100 MB of f32 gradients), trained with SGD on a fixed
batch: `nexar-candle/examples/ddp_bench.rs` on nexar's side, `bench/ddp_torch.py` on torch's,
with the same shapes, initialisation, global batch (`--batch`, each rank half of it), bucket cap
(`--bucket-mb`, 25 MiB with a 1 MiB first bucket on both sides) and threads per process
(`--threads`: `RAYON_NUM_THREADS` for candle, `torch.set_num_threads` and `OMP_NUM_THREADS` for
torch). Each round runs, for each framework in turn, the single-process step on half the batch
(`--local`), then DDP with each hook: plain, bf16 (`CommHook::Compressed(Bf16)` /
`bf16_compress_hook`) and PowerSGD (rank `--powersgd-rank`, from step `--powersgd-start`, on
both sides `powerSGD_hook`'s defaults otherwise: error feedback, warm start, compression rate
2). The frameworks' order alternates from round to round.

PowerSGD runs with buckets of `--powersgd-bucket-mb` (default 100 MiB: the 1 MiB first bucket,
then the whole model in one), on both sides: torch's `powerSGD_hook` over Gloo fails with several
buckets in flight (torch 2.15: "op.preamble.length <= op.nbytes. 28000 vs 7000. Received data
size doesn't match expected size", on the first compressed step). Each bucket's hook issues its
second allreduce (`Q`) from the first's completion callback, so the ranks can issue one bucket's
`Q` and the next bucket's `P` in different orders, and Gloo pairs mismatched collectives.
`--powersgd-bucket-mb 25` shows it.

Per framework and hook it prints, medians over the rounds (min–max) of each run's median (rank
0's; the ranks are in lock-step):

- the local step and the DDP step, and the DDP step's p99 (median over the rounds of each run's
  p99);
- the overhead: (DDP step − local step) / local step, paired within each round;
- where the DDP step goes: compute (forward, backward and the optimizer), the copies into the
  buckets and back, and the exposed allreduce (the wait for it that nothing hid, the hook's own
  work included). nexar times each part directly (the steps of `Ddp::sync` done one by one on
  the reducer underneath). torch runs its parts inside `backward()`, so `ddp_torch.py` measures
  them by difference in the same process: the same model under `no_sync()` (compute), and a
  second DDP model with a hook that sends nothing (the copies, by difference to its own
  `no_sync()` steps; the exposed allreduce is the DDP step less that no-op step);
- each rank's peak resident memory (`VmHWM`, the larger of the two ranks) with DDP, against the
  single process's: DDP may add one copy of the gradients (the buckets).

    python3 bench/compare_ddp.py --rounds 5

Needs `target/release/nexar` (`cargo build --release -p nexar --features cli --bin nexar`) and
`target/release/examples/ddp_bench` (`cargo build --release -p nexar-candle --example
ddp_bench`). torch goes into a virtualenv this script makes (`--venv`, default
`bench/.venv-torch`, git-ignored; about 5.5 GB: PyPI's torch wheel is built for CUDA and
does not import without its `nvidia-*` libraries, even on a CPU). `--sides nexar` runs nexar
alone, without torch.
"""

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
HOOKS = ["plain", "bf16", "powersgd"]


def ensure_torch(venv, spec):
    """The virtualenv's python, with torch installed in it (made on the first run)."""
    python = os.path.join(venv, "bin", "python")
    if not os.path.exists(python):
        print(f"# making {venv}", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    probe = subprocess.run([python, "-c", "import torch, torch.distributed as d; assert d.is_gloo_available()"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        print(f"# installing {spec} into {venv} (several GB, once)", file=sys.stderr)
        subprocess.run([python, "-m", "pip", "install", "--quiet", spec], check=True)
    return python


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def json_lines(cmd, env):
    """Runs `cmd` and returns the JSON objects it printed, one per line."""
    run = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if run.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({run.returncode}):\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}")
    rows = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    if not rows:
        sys.exit(f"{' '.join(cmd)} printed no result:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}")
    return rows


def bucket_mb(a, hook):
    return a.powersgd_bucket_mb if hook == "powersgd" else a.bucket_mb


def shape_args(a, hook):
    return ["--layers", str(a.layers), "--width", str(a.width), "--batch", str(a.batch), "--steps", str(a.steps),
            "--warmup", str(a.warmup), "--bucket-mb", str(bucket_mb(a, hook)), "--powersgd-rank",
            str(a.powersgd_rank), "--powersgd-start", str(a.powersgd_start)]


def nexar_run(a, hook, env):
    env = dict(env, RAYON_NUM_THREADS=str(a.threads), CANDLE_NUM_THREADS=str(a.threads))
    if hook is None:
        rows = json_lines([a.bench, "--local"] + shape_args(a, hook), env)
    else:
        rows = json_lines([a.nexar, "launch", "-n", "2", a.bench, "--hook", hook] + shape_args(a, hook), env)
    return summarise(rows, "nexar")


def torch_run(a, python, hook):
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads))
    script = os.path.join(HERE, "ddp_torch.py")
    threads = ["--threads", str(a.threads)]
    if hook is None:
        rows = json_lines([python, script, "--local"] + shape_args(a, hook) + threads, env)
    else:
        cmd = [python, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
               script, "--hook", hook] + shape_args(a, hook) + threads
        rows = json_lines(cmd, env)
    return summarise(rows, "torch")


def summarise(rows, framework):
    """One run's figures: rank 0's times, the largest peak memory of the ranks."""
    r0 = next(r for r in rows if r["rank"] == 0)
    out = {"step": r0["step_ms"], "p99": r0["step_p99_ms"], "peak": max(r["peak_rss_mib"] for r in rows),
           "faults": r0["minor_faults_per_step"],
           "params": r0["params"], "tensors": r0["tensors"], "threads": r0["threads"]}
    if r0["mode"] == "ddp":
        if framework == "nexar":
            out.update(compute=r0["compute_opt_ms"], copies=r0["copy_in_ms"] + r0["copy_out_ms"],
                       exposed=r0["exposed_ms"], copy_in=r0["copy_in_ms"], copy_out=r0["copy_out_ms"])
        else:
            out.update(compute=r0["compute_ms"], copies=r0["copies_ms"], exposed=r0["exposed_ms"])
    return out


def spread(values, digits=1, unit=""):
    med = statistics.median(values)
    return f"{med:,.{digits}f}{unit} ({min(values):,.{digits}f}–{max(values):,.{digits}f})"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--sides", default="nexar,torch", help="nexar, torch or both (comma-separated)")
    p.add_argument("--hooks", default=",".join(HOOKS))
    p.add_argument("--layers", type=int, default=25)
    p.add_argument("--width", type=int, default=1000)
    p.add_argument("--batch", type=int, default=64, help="global batch; each of the 2 ranks gets half")
    p.add_argument("--steps", type=int, default=30, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--bucket-mb", type=int, default=25)
    p.add_argument("--powersgd-bucket-mb", type=int, default=100,
                   help="bucket cap of the PowerSGD runs, both frameworks (see the note on torch above)")
    p.add_argument("--powersgd-rank", type=int, default=4)
    p.add_argument("--powersgd-start", type=int, default=2,
                   help="torch requires at least 2 with error feedback or warm start")
    p.add_argument("--threads", type=int, default=1, help="compute threads per process, both frameworks")
    p.add_argument("--shm-off", action="store_true",
                   help="also run nexar with NEXAR_SHM=off (its TCP lane; Gloo uses TCP over loopback)")
    p.add_argument("--malloc", choices=["default", "keep"], default="default",
                   help="keep: glibc's malloc keeps freed memory (MALLOC_MMAP_THRESHOLD_ and MALLOC_TRIM_THRESHOLD_ "
                        "raised, for every process of both frameworks) instead of giving it back and faulting it "
                        "in again at the next step")
    p.add_argument("--venv", default=os.path.join(HERE, ".venv-torch"))
    p.add_argument("--torch-spec", default="torch==2.15.0", help="what pip installs into the virtualenv")
    p.add_argument("--nexar", default=os.path.join(ROOT, "target", "release", "nexar"))
    p.add_argument("--bench", default=os.path.join(ROOT, "target", "release", "examples", "ddp_bench"))
    p.add_argument("--json", help="write every run's figures here")
    a = p.parse_args()
    sides = a.sides.split(",")
    hooks = a.hooks.split(",")
    if "nexar" in sides:
        for path in (a.nexar, a.bench):
            if not os.path.exists(path):
                sys.exit(f"{path} is missing (see this script's help)")
    python = ensure_torch(a.venv, a.torch_spec) if "torch" in sides else None
    if a.malloc == "keep":
        os.environ.update(MALLOC_MMAP_THRESHOLD_=str(1 << 30), MALLOC_TRIM_THRESHOLD_=str(1 << 34))

    frameworks = []
    if "nexar" in sides:
        frameworks.append(("nexar", dict(os.environ)))
        if a.shm_off:
            frameworks.append(("nexar, NEXAR_SHM=off", dict(os.environ, NEXAR_SHM="off")))
    if "torch" in sides:
        frameworks.append(("torch", None))
    runs = {(f, h): [] for f, _ in frameworks for h in [None] + hooks}
    for r in range(a.rounds):
        order = frameworks if r % 2 == 0 else frameworks[::-1]
        for name, env in order:
            for hook in [None] + hooks:
                res = torch_run(a, python, hook) if name == "torch" else nexar_run(a, hook, env)
                runs[(name, hook)].append(res)
        print(f"# round {r + 1}/{a.rounds} done", file=sys.stderr)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({f"{k[0]} {k[1] or 'local'}": v for k, v in runs.items()}, f, indent=1)

    first = runs[(frameworks[0][0], None)][0]
    grads_mib = first["params"] * 4 / (1 << 20)
    print(f"# {a.rounds} alternating rounds, np 2 on one host; MLP {a.layers} × Linear({a.width}, {a.width}): "
          f"{first['tensors']} tensors, {first['params'] / 1e6:.1f} M parameters ({grads_mib:.0f} MiB of f32 "
          f"gradients); global batch {a.batch} ({a.batch // 2} per rank, and in the local step); bucket cap "
          f"{a.bucket_mb} MiB ({a.powersgd_bucket_mb} MiB for PowerSGD); {a.threads} compute thread(s) per process; PowerSGD rank {a.powersgd_rank} "
          f"from step {a.powersgd_start}; glibc malloc {a.malloc}; {a.warmup} warm-up and {a.steps} timed steps per run; times in ms, "
          "median (min–max) over the rounds; overhead = (DDP − local) / local, paired per round; compute = "
          "forward + backward + optimizer; copies = into the buckets and back; exposed = allreduce wait not hidden")
    print("| framework | hook | local step | DDP step | DDP p99 | overhead | compute | copies | exposed comm "
          "| peak RSS local → DDP (MiB) | page faults per step, local / DDP |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, _ in frameworks:
        local = runs[(name, None)]
        for hook in hooks:
            ddp = runs[(name, hook)]
            overhead = [100.0 * (d["step"] - l["step"]) / l["step"] for d, l in zip(ddp, local)]
            peak_local = statistics.median(l["peak"] for l in local)
            peak_ddp = statistics.median(d["peak"] for d in ddp)
            print(f"| {name} | {hook} | {spread([l['step'] for l in local])} | {spread([d['step'] for d in ddp])} "
                  f"| {statistics.median(d['p99'] for d in ddp):.1f} | {spread(overhead, 0, ' %')} "
                  f"| {spread([d['compute'] for d in ddp])} | {spread([d['copies'] for d in ddp])} "
                  f"| {spread([d['exposed'] for d in ddp])} | {peak_local:,.0f} → {peak_ddp:,.0f} "
                  f"(+{peak_ddp - peak_local:,.0f}) | {statistics.median(l['faults'] for l in local):,.0f} / "
                  f"{statistics.median(d['faults'] for d in ddp):,.0f} |")


if __name__ == "__main__":
    main()
