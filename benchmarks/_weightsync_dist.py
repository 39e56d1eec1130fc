"""Weight sync part 2: bucketed, pipelined broadcast over gloo against the seed and peers.

Run: hatch run python benchmarks/_weightsync_dist.py [--quick] [--json PATH] [--receivers N]
(benchmarks/weightsync.py imports this module and calls ``part2(args)``.)

Two processes (one sender, ``--receivers`` receivers, default 1) on this machine, over gloo on
loopback. The state dict (1 GiB; ``--quick``: 128 MiB) is about 70% large bf16 tensors, 2,000
small fp32 tensors and a few int64 ones. The receiver's live tensors exist before the clock
starts; every method below moves the same bytes, each one measured several times, methods
interleaved round-robin so machine noise hits them alike, and the best run counts (the
machine is shared: the fastest run is the one least disturbed by other work):

  ceiling        one broadcast of a single ready uint8 buffer of the state dict's size: what
                 the wire does with no packing, no metadata and no copy at either end.
  per-parameter  one blocking broadcast per tensor, as OpenRLHF's and TRL's refit do it: the
                 receiver takes an empty tensor of the parameter's shape and dtype, broadcasts
                 into it and loads it into the live tensor (their ``load_weights``: one copy).
                 Their ``torch.empty`` runs under CUDA's caching allocator, which hands back
                 the block the previous weight freed; here one reused block plays that part
                 (fresh CPU pages would add page faults the GPU never pays). Their
                 per-parameter RPC (a Ray call or an HTTP request naming the tensor) is left
                 out, in the baseline's favour.
  per-param live the same broadcasts straight into the receiver's live tensors, with no
                 allocation and no load: the pattern's best case, reported beside the claim.
  seed           the rlightning seed: per dtype, ``parameters_to_vector`` (a torch.cat of
                 every tensor: a whole model copy) broadcast with ``async_op=True``; the
                 receiver allocates a flat tensor per dtype and narrows it into a state dict
                 (a whole model copy; applying it would cost one more copy, not counted).
  ours           `BroadcastSender` / `BroadcastReceiver`: header + negotiation, bucket k+1
                 on its way while bucket k is on the wire, a two-phase commit; the receiver
                 applies into its live tensors with a "None" buffer written in place (what
                 per-parameter does, so the two compare like for like). The sender's tensors
                 were `adopt`ed once into one block laid out as the buckets, so every run of
                 tensors is sent as it lies (no packing copy).
  ours, scattered  the same from a copy of the sender's state dict whose tensors lie where torch
                 allocated them: runs of small tensors are packed into a bucket buffer (bucket
                 k+1 packed while bucket k is on the wire), large ones sent from their own
                 storage. Reported beside the claims.
  ours atomic    the same into an atomic "None" buffer (stages the version, copies at commit):
                 shown for reference, not in a claim.
  ours double    the same into a `DoubleBuffer(mode="swap")` (atomic: large tensors land in
                 the staging storages, `TensorTarget`; commit swaps storages): reference only.
  ours landed    the same into a one-member `ShardedBuffer` (an atomic flat double buffer that
                 offers its storage as the landing zone, `BucketTarget`; commit swaps): the
                 transport with no copy on the receiving side, as the ceiling has none.

Claims: speed-up over per-parameter with "ours" (both apply into the live tensors; the ratio
over "per-param live" is reported beside it);
transport efficiency against the ceiling with "ours landed" (neither copies on arrival; the
in-place ratio is reported beside it); peak extra memory of "ours" in buckets.

Peak memory: each process resets its peak-RSS counter (/proc/self/clear_refs) before a run
and reads VmHWM after it; "extra" is the peak above the RSS before the run.
"""

from __future__ import annotations

import gc
import os
import sys
import time
import traceback
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

from _claims import arguments, claim, free_port, report
from _state import GiB, MiB, build_state, model_spec


# -- memory ------------------------------------------------------------------------------------
def _status_kib(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def reset_peak() -> int:
    """Reset VmHWM to the current RSS; returns the current RSS in bytes."""
    gc.collect()
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
    except OSError:
        pass
    return _status_kib("VmRSS") * 1024


def peak_rss() -> int:
    return _status_kib("VmHWM") * 1024


# -- methods -----------------------------------------------------------------------------------
def _consumer(live: Mapping[str, Any], layout: Any, atomic: bool) -> Any:
    from rlfleet.weightsync import DirectBuffer

    return DirectBuffer(live, layout, max_staging_bytes=None if atomic else 0)


def _worker(
    rank: int, world: int, port: int, cfg: dict[str, Any], queue: Any, body: Callable[..., Any] | None = None
) -> None:
    try:
        queue.put((rank, "ok", (body or _run)(rank, world, port, cfg)))
    except BaseException as exc:
        queue.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    queue.close()
    queue.join_thread()
    os._exit(0)


def join_gloo(rank: int, world: int, port: int, threads: int, timeout_s: float) -> None:
    """This process's torch threads, then the gloo world on loopback `port` (every body's start)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=timeout_s),
    )


def _run(rank: int, world: int, port: int, cfg: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from rlfleet.weightsync import BroadcastReceiver, BroadcastSender, Layout

    join_gloo(rank, world, port, cfg["threads"], 300.0)
    spec = [(n, tuple(s), d) for n, s, d in cfg["spec"]]
    live = build_state(spec, fill=rank == 0)
    bucket = cfg["bucket_bytes"]
    layout = Layout.from_state_dict(live, bucket)
    total = layout.total_bytes
    by_dtype: dict[Any, list[str]] = {}
    for name, t in live.items():
        by_dtype.setdefault(t.dtype, []).append(name)

    ceiling_buf = torch.ones(total, dtype=torch.uint8) if rank == 0 else torch.zeros(total, dtype=torch.uint8)

    def ceiling() -> None:
        dist.broadcast(ceiling_buf, 0)

    largest = max(t.numel() * t.element_size() for t in live.values())
    scratch = torch.empty(largest if rank != 0 else 0, dtype=torch.uint8)

    def per_parameter() -> None:
        for t in live.values():
            if rank == 0:
                dist.broadcast(t, 0)
                continue
            # torch.empty on the GPU hands back the block the previous weight freed (CUDA's
            # caching allocator); on the CPU it would be fresh pages each time, page faults
            # the GPU never pays: a reused block keeps the baseline as fast as on its home
            weight = scratch[: t.numel() * t.element_size()].view(t.dtype).view(t.shape)
            dist.broadcast(weight, 0)
            t.copy_(weight)  # the receiver's load_weights

    def per_param_live() -> None:
        for t in live.values():
            dist.broadcast(t, 0)

    def seed() -> None:
        works, flats = [], []
        for dtype, names in by_dtype.items():
            if rank == 0:
                flat = torch.nn.utils.parameters_to_vector([live[n] for n in names])
            else:
                flat = torch.empty(sum(live[n].numel() for n in names), dtype=dtype)
            works.append(dist.broadcast(flat, 0, async_op=True))
            flats.append((flat, names))
        for w in works:
            w.wait()
        if rank != 0:
            received: dict[str, torch.Tensor] = {}
            for flat, names in flats:
                offset = 0
                for n in names:
                    k = live[n].numel()
                    received[n] = flat.narrow(0, offset, k).view_as(live[n])
                    offset += k
            del received

    version = [0]
    if rank == 0:
        from rlfleet.weightsync import adopt

        sender = BroadcastSender(layout, None, 0)
        scattered = {name: t.clone() for name, t in live.items()}  # where torch put each tensor
        adopt(live, layout)  # the trainer's tensors in one block: each run is sent as it lies

        def ours() -> None:
            version[0] += 1
            sender.send(live, version[0], 600.0)

        def ours_scattered() -> None:
            version[0] += 1
            sender.send(scattered, version[0], 600.0)

        ours_atomic = ours
        ours_double = ours
        ours_landed = ours
    else:
        receiver = BroadcastReceiver(layout, None, 0)
        in_place = _consumer(live, layout, atomic=False)
        atomic = _consumer(live, layout, atomic=True)

        def ours() -> None:
            receiver.receive(in_place, 600.0)

        ours_scattered = ours

        def ours_atomic() -> None:
            receiver.receive(atomic, 600.0)

        from rlfleet.weightsync import DoubleBuffer, ShardedBuffer

        double = DoubleBuffer(live, layout, mode="swap")

        def ours_double() -> None:
            receiver.receive(double, 600.0)

        flat = ShardedBuffer(layout, 0, 1)

        def ours_landed() -> None:
            receiver.receive(flat, 600.0)

    methods: dict[str, Callable[[], None]] = {
        "ceiling": ceiling,
        "per-parameter": per_parameter,
        "per-param live": per_param_live,
        "seed": seed,
        "ours": ours,
        "ours, scattered": ours_scattered,
        "ours atomic": ours_atomic,
        "ours double": ours_double,
        "ours landed": ours_landed,
    }
    times: dict[str, list[float]] = {m: [] for m in methods}
    extra: dict[str, int] = dict.fromkeys(methods, 0)
    for fn in methods.values():  # warm-up: connections, page faults of reused buffers
        dist.barrier()
        fn()
    for _ in range(cfg["reps"]):
        for name, fn in methods.items():
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            dist.barrier()
            times[name].append(time.perf_counter() - t0)
    transport = sender if rank == 0 else receiver
    for name, fn in methods.items():  # memory: one more run each, our bucket buffers freed first
        transport.release_buffers()
        if rank != 0:
            flat.release_pending()
        dist.barrier()
        base = reset_peak()
        dist.barrier()
        fn()
        dist.barrier()
        extra[name] = peak_rss() - base
    if rank != 0 and cfg.get("verify", True):
        from rlfleet.weightsync import checksum

        ours()  # one more sync, then check the receiver holds the sender's bytes
        return {"times": times, "extra": extra, "total": total, "checksum": checksum(live)}
    if rank == 0 and cfg.get("verify", True):
        ours()
        from rlfleet.weightsync import checksum

        return {"times": times, "extra": extra, "total": total, "checksum": checksum(live)}
    return {"times": times, "extra": extra, "total": total}


def run_processes(
    cfg: dict[str, Any], world: int, timeout: float, body: Callable[..., Any] | None = None
) -> dict[int, dict[str, Any]]:
    """`body(rank, world, port, cfg)` (default: this part's `_run`) in `world` spawned processes;
    their results by rank."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world, port, cfg, queue, body), daemon=True)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    results: dict[int, dict[str, Any]] = {}
    end = time.monotonic() + timeout
    try:
        while len(results) < world:
            left = end - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"benchmark processes did not finish within {timeout:.0f}s")
            try:
                rank, status, value = queue.get(timeout=min(left, 1.0))
            except Exception:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"a benchmark process died (exit code {dead[0].exitcode})") from None
                continue
            if status != "ok":
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            results[rank] = value
    finally:
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
    return results


def part2(args: Any) -> dict[str, dict[str, Any]]:
    """Run the gloo comparison; print a table; return the claims."""
    quick = bool(getattr(args, "quick", False))
    receivers = int(getattr(args, "receivers", 1) or 1)
    total = 128 * MiB if quick else GiB
    bucket = int(getattr(args, "bucket_mib", 0) or (64 if quick else 256)) * MiB
    cfg = {
        "spec": model_spec(total),
        "bucket_bytes": bucket,
        "reps": 3 if quick else 5,
        "threads": 1,
        "verify": True,
    }
    print(
        f"part 2: gloo broadcast, 1 sender -> {receivers} receiver(s), "
        f"{total / MiB:.0f} MiB state dict ({len(cfg['spec'])} tensors), bucket {bucket / MiB:.0f} MiB",
        flush=True,
    )
    results = run_processes(cfg, 1 + receivers, timeout=300 if quick else 900)
    sums = {r["checksum"] for r in results.values()}
    if len(sums) != 1:
        raise RuntimeError("receiver's weights differ from the sender's after the benchmark")
    nbytes = results[0]["total"]
    # a run ends when the last process ends: take the slowest rank per repeat
    med: dict[str, float] = {}
    for m in results[0]["times"]:
        per_rep = [
            max(r["times"][m][i] for r in results.values()) for i in range(len(results[0]["times"][m]))
        ]
        med[m] = min(per_rep)
    gbps = {m: nbytes / t / 1e9 for m, t in med.items()}
    send_extra = {m: results[0]["extra"][m] for m in med}
    recv_extra = {m: max(r["extra"][m] for rank, r in results.items() if rank != 0) for m in med}
    print(f"{'method':16s} {'GB/s':>7s} {'x ceiling':>10s} {'sender +MiB':>12s} {'receiver +MiB':>14s}")
    for m in med:
        print(
            f"{m:16s} {gbps[m]:7.2f} {gbps[m] / gbps['ceiling']:10.2f} "
            f"{send_extra[m] / MiB:12.0f} {recv_extra[m] / MiB:14.0f}"
        )
    ours_extra = max(send_extra["ours"], recv_extra["ours"])
    seed_extra = max(send_extra["seed"], recv_extra["seed"])
    print(
        f"ours vs per-parameter: {gbps['ours'] / gbps['per-parameter']:.2f}x "
        f"({gbps['ours'] / gbps['per-param live']:.2f}x vs its best case, into the live tensors); "
        f"ours vs seed: {gbps['ours'] / gbps['seed']:.2f}x; "
        f"ours peak extra {ours_extra / bucket:.2f} buckets "
        f"(seed: {seed_extra / MiB:.0f} MiB = {seed_extra / nbytes:.2f} model copies)",
        flush=True,
    )
    return {
        "dist_vs_per_parameter_speedup": claim(gbps["ours"] / gbps["per-parameter"], 1.5, "x"),
        "dist_vs_per_parameter_live_speedup": claim(gbps["ours"] / gbps["per-param live"], None, "x"),
        # The 0.8 target is for the full 1 GiB run: at the quick size the fixed costs weigh more
        # and the ratio moves with the box's load (README), so --quick reports it.
        "dist_over_ceiling": claim(gbps["ours landed"] / gbps["ceiling"], None if args.quick else 0.8, "x"),
        "dist_inplace_over_ceiling": claim(gbps["ours"] / gbps["ceiling"], None, "x"),
        "dist_peak_extra_over_bucket": claim(ours_extra / bucket, 2.0, "buckets", higher_is_better=False),
        "dist_vs_seed_speedup": claim(gbps["ours"] / gbps["seed"], None, "x"),
        "seed_peak_extra_over_model": claim(seed_extra / nbytes, None, "model copies"),
    }


def main(argv: list[str] | None = None) -> int:
    ap = arguments((__doc__ or "").split("\n\n")[0])
    ap.add_argument("--receivers", type=int, default=1)
    ap.add_argument("--bucket-mib", type=int, default=0, help="bucket size (default: 64 quick, 256 full)")
    args = ap.parse_args(argv)
    return report(part2(args), args.json, title="weightsync part 2 (gloo)")


if __name__ == "__main__":
    sys.exit(main())
