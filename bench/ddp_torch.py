#!/usr/bin/env python3
"""PyTorch's side of `bench/compare_ddp.py`: the MLP of `nexar-candle/examples/ddp_bench.rs`
(`--layers` Linear layers of `--width`, weights drawn as candle draws them, SGD on a fixed batch
against a fixed target, MSE), trained in one process (`--local`, half the global batch) or under
DDP with the Gloo backend on CPU (under `torch.distributed.run`, each rank `--batch / world`).

    python ddp_torch.py --local --threads 1
    python -m torch.distributed.run --nproc-per-node 2 ddp_torch.py --hook bf16 --threads 1

Each process prints one JSON line, in milliseconds, median and p99 over the timed steps, and its
peak resident memory (`VmHWM`) and the minor page faults per step. How the DDP step is split, in the same process:

- phase 1, the DDP model with the hook asked for (`plain`: no hook, DDP's own allreduce, `bf16`:
  `bf16_compress_hook`, `powersgd`: `powerSGD_hook`), timed steps alternating with steps of the
  same model under `no_sync()` (no bucket is touched, nothing is sent): `step` and `compute`
  (forward, backward and the optimizer, as in the DDP step). The peak memory is read here.
- phase 2, a fresh model of the same shapes under DDP with a hook that sends nothing (it hands
  the bucket back as it is: the copies into the buckets and back, DDP's bookkeeping, no
  communication), again alternating with `no_sync()` steps: `copies` = that step less the
  `no_sync()` step, and `exposed` = phase 1's DDP step less this no-op step: the allreduce time
  (and the hook's own work: casts, PowerSGD's products) that backward did not hide.

Standard library and torch only; `bench/compare_ddp.py` makes a virtualenv with torch in it.
"""

import argparse
import json
import math
import os
import resource
import statistics
import time


def parse():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--local", action="store_true")
    p.add_argument("--hook", choices=["plain", "bf16", "powersgd"], default="plain")
    p.add_argument("--layers", type=int, default=25)
    p.add_argument("--width", type=int, default=1000)
    p.add_argument("--batch", type=int, default=64, help="the global batch")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--bucket-mb", type=int, default=25)
    p.add_argument("--powersgd-rank", type=int, default=4)
    p.add_argument("--powersgd-start", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads per process")
    return p.parse_args()


def status_mib(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024.0
    return 0.0


def stats(values):
    s = sorted(values)
    return statistics.median(s), s[max(1, math.ceil(0.99 * len(s))) - 1]


def main():
    a = parse()
    os.environ["OMP_NUM_THREADS"] = str(a.threads)
    import torch
    import torch.nn as nn

    torch.set_num_threads(a.threads)

    def model():
        layers = []
        for i in range(a.layers):
            lin = nn.Linear(a.width, a.width)
            # candle's `linear`: Kaiming normal for ReLU (std sqrt(2 / fan_in)), bias uniform
            # in ±1/sqrt(fan_in).
            with torch.no_grad():
                lin.weight.normal_(0.0, math.sqrt(2.0 / a.width))
                lin.bias.uniform_(-1.0 / math.sqrt(a.width), 1.0 / math.sqrt(a.width))
            layers.append(lin)
            if i + 1 < a.layers:
                layers.append(nn.ReLU())
        return nn.Sequential(*layers)

    faults = [0]

    def step(net, opt, x, target, count=False):
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(net(x), target)
        loss.backward()
        opt.step()
        took = (time.perf_counter() - start) * 1e3
        if count:
            faults[0] += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
        return took

    out = {"framework": "torch", "torch": torch.__version__, "threads": torch.get_num_threads(),
           "layers": a.layers, "width": a.width, "batch": a.batch, "steps": a.steps}

    if a.local:
        per_rank = a.batch // 2
        net = model()
        opt = torch.optim.SGD(net.parameters(), lr=a.lr)
        x, target = torch.randn(per_rank, a.width), torch.randn(per_rank, a.width)
        times = [step(net, opt, x, target, count=i >= a.warmup) for i in range(a.warmup + a.steps)][a.warmup:]
        m, p = stats(times)
        params = list(net.parameters())
        out.update(mode="local", hook="none", rank=0, world=1, per_rank_batch=per_rank, tensors=len(params),
                   params=sum(t.numel() for t in params), step_ms=m, step_p99_ms=p, compute_ms=m,
                   peak_rss_mib=status_mib("VmHWM"), rss_mib=status_mib("VmRSS"),
                   minor_faults_per_step=faults[0] / a.steps)
        print(json.dumps(out), flush=True)
        return

    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    per_rank = a.batch // world
    x, target = torch.randn(per_rank, a.width), torch.randn(per_rank, a.width)

    def alternate(ddp, opt, count=False):
        """Warm-up steps, then timed DDP steps alternating with `no_sync()` steps."""
        synced, local = [], []
        for i in range(a.warmup + a.steps):
            t = step(ddp, opt, x, target, count=count and i >= a.warmup)
            with ddp.no_sync():
                u = step(ddp, opt, x, target)
            if i >= a.warmup:
                synced.append(t)
                local.append(u)
        return synced, local

    net = model()
    ddp = DDP(net, bucket_cap_mb=a.bucket_mb)
    if a.hook == "bf16":
        ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
    elif a.hook == "powersgd":
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=a.powersgd_rank,
                                            start_powerSGD_iter=a.powersgd_start, min_compression_rate=2,
                                            use_error_feedback=True, warm_start=True)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=a.lr)
    synced, compute = alternate(ddp, opt, count=True)
    peak, rss = status_mib("VmHWM"), status_mib("VmRSS")
    params = list(net.parameters())
    out.update(tensors=len(params), params=sum(t.numel() for t in params))
    del ddp, opt, net

    def noop(_state, bucket):
        fut = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut

    net = model()
    ddp = DDP(net, bucket_cap_mb=a.bucket_mb)
    ddp.register_comm_hook(None, noop)
    opt = torch.optim.SGD(ddp.parameters(), lr=a.lr)
    nocomm, compute2 = alternate(ddp, opt)

    s, s99 = stats(synced)
    c, c99 = stats(compute)
    n, _ = stats(nocomm)
    c2, _ = stats(compute2)
    out.update(mode="ddp", hook=a.hook, rank=rank, world=world, per_rank_batch=per_rank, step_ms=s, step_p99_ms=s99,
               compute_ms=c, compute_p99_ms=c99, noop_step_ms=n, noop_compute_ms=c2, copies_ms=n - c2,
               exposed_ms=s - n, peak_rss_mib=peak, rss_mib=rss, minor_faults_per_step=faults[0] / a.steps)
    print(json.dumps(out), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
