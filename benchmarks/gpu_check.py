"""GPU check of weightsync's GPU paths, in one call: CUDA IPC, NCCL, offload, device memcpy.

Run on a GPU machine (CuPy installed: the ``[cuda12]`` / ``[cuda13]`` extra), without hatch:

    PYTHONPATH=packages/weightsync/src python3 benchmarks/gpu_check.py --quick --json gpu.json

What it checks (each a claim; bit-exact ones have target 1, figures are reported):
  memcpy       device-to-device copy of the model's bytes (torch): the reference bandwidth;
  cuda ipc     two processes, `CudaIpcSender` -> `CudaIpcReceiver` over GPU slots shared by IPC
               handle: versions applied in place ("None"), then into a `DoubleBuffer` on the GPU,
               with one version whose consumer fails after queueing a side-stream read of its
               slot (nothing applied; the read sees that version's bytes, so the receiver waited
               for the device before releasing the slot); reader bytes compared with a fresh
               copy; bandwidth against memcpy;
  worker ipc   policygroup's same-node GPU path at its endpoint level, without Ray: a writer's
               `WorkerWeights.ipc_channel` / `ipc_send` to two reader processes whose
               `ipc_receive` lands in a "Double" and a "None" endpoint on the GPU (what a sync
               plan's "cuda_ipc" step runs); several versions through one reused channel, bit-exact
               against a fresh copy; a version that fails on the writer closes the channel, the
               readers fail at once (PeerLostError) keeping the previous version, and the next
               version goes through a new channel; bandwidth against memcpy;
  nccl         a one-rank communicator through CuPy's real API and the protocol's bucket loop
               (wire bytes, tensors untouched), rebuilt on the same store and name, and an init
               whose second rank never comes, which must end at its deadline naming it;
  offload      a module with gradients and Adam state offloaded to pinned memory and reloaded
               bit-exact, with a write pending on a side stream; memory freed and handed back.
Every step runs under a timeout (children are killed), the whole script under an alarm, and a
failed step is a missed claim with a one-line error in the table (tracebacks after it). Exit
status: 0 when every claim holds, 1 otherwise. Without CUDA it reports every claim skipped and
exits 0; ``--cpu-dry-run`` runs the IPC parts (host slots) and offload on the CPU instead, to
check this script where no GPU is.
"""

from __future__ import annotations

import os
import signal
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping
from typing import Any

from _claims import Claim, arguments, claim, report
from _gpu_check_channel import READERS, channel_double, channel_none, channel_writer
from _gpu_check_parts import ipc_reader, ipc_sender, nccl_child, offload_check
from _state import GiB, MiB, gpu_model_spec

YES = "1 = yes"
#: name -> (target, unit): what a GPU run reports.
CLAIMS: dict[str, tuple[float | None, str]] = {
    "device_memcpy_gbps": (None, "GB/s"),
    "cuda_ipc_bit_exact": (1, YES),
    "cuda_ipc_abort_keeps_previous": (1, YES),
    "cuda_ipc_failed_read_settled": (1, YES),
    "cuda_ipc_double_buffer_bit_exact": (1, YES),
    "cuda_ipc_sync_over_memcpy": (None, "x memcpy"),
    "cuda_ipc_double_buffer_over_memcpy": (None, "x memcpy"),
    "worker_ipc_channel_bit_exact": (1, YES),
    "worker_ipc_channel_failure_keeps_previous": (1, YES),
    "worker_ipc_channel_over_memcpy": (None, "x memcpy"),
    "nccl_bucket_loop_ok": (1, YES),
    "nccl_rebuild_same_name_ok": (1, YES),
    "nccl_init_bounded": (1, YES),
    "nccl_loop_over_memcpy": (None, "x memcpy"),
    "offload_reload_bit_exact": (1, YES),
    "offload_frees_device_memory": (1, YES),
    "offload_empty_cache_returns_memory": (1, YES),
}
GPU_ONLY = {
    "device_memcpy_gbps",
    "cuda_ipc_failed_read_settled",
    "cuda_ipc_sync_over_memcpy",
    "cuda_ipc_double_buffer_over_memcpy",
    "worker_ipc_channel_over_memcpy",
    "nccl_bucket_loop_ok",
    "nccl_rebuild_same_name_ok",
    "nccl_init_bounded",
    "nccl_loop_over_memcpy",
    "offload_empty_cache_returns_memory",
}


def log(msg: str) -> None:
    print(f"[gpu_check {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def cupy_version() -> str:
    try:
        import cupy
    except Exception as exc:  # ImportError, or a CUDA mismatch while loading
        return f"not importable ({one_line(exc)})"
    return str(cupy.__version__)


def yes(flag: bool) -> Claim:
    return claim(1 if flag else 0, 1, YES)


def skipped(name: str, reason: str) -> Claim:
    target, unit = CLAIMS[name]
    return {"value": None, "target": target, "unit": f"{unit} (skipped: {reason})", "ok": True}


def missed(name: str, error: str) -> Claim:
    target, unit = CLAIMS[name]
    return {"value": f"ERROR {error}", "target": target, "unit": unit, "ok": False}


def one_line(exc: BaseException, limit: int = 90) -> str:
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


class Steps:
    """Runs each step; a step that raises marks its claims missed and keeps its traceback."""

    def __init__(self) -> None:
        self.claims: dict[str, Claim] = {}
        self.tracebacks: list[str] = []

    def run(self, names: list[str], step: Callable[[], dict[str, Claim]]) -> None:
        try:
            self.claims.update(step())
        except BaseException as exc:  # the alarm's TimeoutError included: report, do not crash
            log(f"{names[0].split('_')[0]} step FAILED: {one_line(exc)}")
            self.tracebacks.append(f"{', '.join(names)}:\n{traceback.format_exc()}")
            for name in names:
                self.claims.setdefault(name, missed(name, one_line(exc)))


# -- processes -------------------------------------------------------------------------------------
def _child(body: Callable[[Mapping[str, Any]], dict[str, Any]], role: str, cfg: Any, queue: Any) -> None:
    try:
        queue.put((role, "ok", body(cfg)))
    except BaseException as exc:
        queue.put((role, "error", f"{one_line(exc)}\n{traceback.format_exc()}"))
    queue.close()
    queue.join_thread()
    os._exit(0)  # leave at once: a stuck NCCL init thread (the bounded-init check) must not hold exit


def run_children(
    bodies: dict[str, Callable[..., dict[str, Any]]], cfg: Mapping[str, Any], timeout: float
) -> dict[str, Any]:
    """Each body in its own spawned process; results by role; any failure raises (children killed)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = {
        role: ctx.Process(target=_child, args=(body, role, dict(cfg), queue), daemon=True)
        for role, body in bodies.items()
    }
    for proc in procs.values():
        proc.start()
    results: dict[str, Any] = {}
    end = time.monotonic() + timeout
    try:
        while len(results) < len(procs):
            if time.monotonic() > end:
                raise TimeoutError(
                    f"{sorted(set(procs) - set(results))} did not finish within {timeout:.0f}s"
                )
            try:
                role, status, value = queue.get(timeout=1.0)
            except Exception:  # queue.Empty: check for a child that died without a word
                dead = [r for r, p in procs.items() if r not in results and p.exitcode is not None]
                if dead:
                    raise RuntimeError(f"{dead[0]} died (exit {procs[dead[0]].exitcode})") from None
                continue
            if status != "ok":
                line, _, trace = value.partition("\n")
                raise RuntimeError(f"{role}: {line}\n{trace}")
            results[role] = value
            log(f"{role} finished")
    finally:
        for proc in procs.values():
            proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
    return results


# -- steps -----------------------------------------------------------------------------------------
def memcpy_gbps(nbytes: int, reps: int) -> float:
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return nbytes / statistics.median(times) / 1e9


def ratio(name: str, gbps: float, memcpy: float | None, dry: bool) -> Claim:
    """A bandwidth over device memcpy (reported, no target yet)."""
    if dry:
        return skipped(name, "cpu dry run")
    if not memcpy:
        return missed(name, "no device memcpy to compare with")
    return claim(gbps / memcpy, None, CLAIMS[name][1])


def ipc_claims(cfg: dict[str, Any], memcpy: float | None, dry: bool) -> dict[str, Claim]:
    with tempfile.TemporaryDirectory(prefix="rlfleet-gpucheck-") as tmp:
        cfg = {**cfg, "path": os.path.join(tmp, "channel")}
        res = run_children({"sender": ipc_sender, "reader": ipc_reader}, cfg, timeout=cfg["timeout"])
    sender, reader = res["sender"], res["reader"]
    reps = cfg["reps"]
    log(f"cuda ipc: reader {reader}")
    out = {
        "cuda_ipc_bit_exact": yes(
            reader["in_place_version"] == reps + 1 and not reader["in_place_mismatched"]
        ),
        "cuda_ipc_abort_keeps_previous": yes(
            sender["aborted"] == "SyncAbortedError"
            and reader["abort_error"] == "SyncAbortedError"
            and reader["abort_version"] == reps + 2
            and not reader["abort_mismatched"]
        ),
        "cuda_ipc_double_buffer_bit_exact": yes(
            reader["double_version"] == 2 * reps + 4 and not reader["double_mismatched"]
        ),
    }
    for name, times in (
        ("cuda_ipc_sync_over_memcpy", sender["in_place"]),
        ("cuda_ipc_double_buffer_over_memcpy", sender["double"]),
    ):
        gbps = sender["tensor_bytes"] / statistics.median(times) / 1e9
        log(f"cuda ipc: {name} {gbps:.1f} GB/s (tensor bytes / median sync)")
        out[name] = ratio(name, gbps, memcpy, dry)
    name = "cuda_ipc_failed_read_settled"
    out[name] = skipped(name, "host slots") if dry else yes(reader["settled"] is True)
    return out


def channel_claims(cfg: dict[str, Any], memcpy: float | None, dry: bool) -> dict[str, Claim]:
    bodies = {"writer": channel_writer, "double": channel_double, "none": channel_none}
    with tempfile.TemporaryDirectory(prefix="rlfleet-gpucheck-") as tmp:
        cfg = {**cfg, "path": os.path.join(tmp, "channel")}
        res = run_children(bodies, cfg, timeout=cfg["timeout"])
    writer, readers = res["writer"], [res["double"], res["none"]]
    log(f"worker ipc: writer {writer}")
    log(f"worker ipc: readers {readers}")
    failed = [r["failed"] for r in readers]
    at_once = all(f["seconds"] < cfg["deadline"] / 2 for f in failed)  # told, not timed out
    gbps = writer["tensor_bytes"] / statistics.median(writer["times"]) / 1e9
    log(f"worker ipc: {gbps:.1f} GB/s (tensor bytes / median send to both readers)")
    return {
        "worker_ipc_channel_bit_exact": yes(
            writer["reused"] and all(r["first_exact"] and r["last_exact"] for r in readers)
        ),
        "worker_ipc_channel_failure_keeps_previous": yes(
            writer["failed"]["type"] == "LayoutMismatchError"
            and writer["closed"]
            and writer["new_channel"]
            and at_once
            and all(f["type"] == "PeerLostError" and "closed by its sender" in f["message"] for f in failed)
            and all(r["kept_exact"] and r["left"] and r["next_exact"] for r in readers)
        ),
        "worker_ipc_channel_over_memcpy": ratio("worker_ipc_channel_over_memcpy", gbps, memcpy, dry),
    }


def nccl_claims(cfg: dict[str, Any], memcpy: float) -> dict[str, Claim]:
    res = run_children({"nccl": nccl_child}, cfg, timeout=cfg["timeout"])["nccl"]
    log(f"nccl: {res}")
    bounded = res["bounded"]
    return {
        "nccl_bucket_loop_ok": yes(bool(res["loops"]) and res["loops"][0] and res["untouched"]),
        "nccl_rebuild_same_name_ok": yes(len(res["loops"]) == 2 and all(res["loops"])),
        "nccl_init_bounded": yes(bounded["missing"] == [1] and bounded["seconds"] < 30.0),
        "nccl_loop_over_memcpy": ratio("nccl_loop_over_memcpy", res["gbps"]["packed"], memcpy, False),
    }


def offload_claims(dry: bool, quick: bool) -> dict[str, Claim]:
    device = "cpu" if dry else "cuda"
    res = offload_check(device, 256 if dry else 4096, 8 if dry or quick else 32)
    log(f"offload: {res}")
    out = {
        "offload_reload_bit_exact": yes(not res["mismatched"]),
        "offload_frees_device_memory": yes(
            res["emptied"] and (dry or res["allocated_drop"] >= 0.99 * res["moved"])
        ),
    }
    name = "offload_empty_cache_returns_memory"
    out[name] = skipped(name, "cpu dry run") if dry else yes(res["reserved_drop"] >= 0.5 * res["moved"])
    return out


# -- main ------------------------------------------------------------------------------------------
def parse(argv: list[str] | None) -> Any:
    ap = arguments((__doc__ or "").split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=0.0, help="state dict size in GiB (default 1 quick, 4 full)")
    ap.add_argument("--bucket-mib", type=int, default=512)
    ap.add_argument("--cpu-dry-run", action="store_true", help="IPC (host slots) and offload on the CPU")
    ap.add_argument("--sync-timeout", type=float, default=120.0, help="deadline of each sync, seconds")
    ap.add_argument(
        "--alarm", type=int, default=0, help="hard limit for the whole script (default 280 quick)"
    )
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    signal.signal(signal.SIGALRM, lambda *_: (_ for _ in ()).throw(TimeoutError("gpu_check alarm")))
    signal.alarm(args.alarm or (280 if args.quick or args.cpu_dry_run else 540))
    try:
        import torch
    except ImportError:
        return report({n: skipped(n, "torch missing") for n in CLAIMS}, args.json, title="gpu_check")
    dry = args.cpu_dry_run
    if not dry and not torch.cuda.is_available():
        log("no CUDA device visible to torch: GPU checks skipped")
        return report({n: skipped(n, "no CUDA device") for n in CLAIMS}, args.json, title="gpu_check")
    if not dry:
        log(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, cupy {cupy_version()}")
    total = int((args.gib or (0.0625 if dry else (1 if args.quick else 4))) * GiB)
    bucket = min(args.bucket_mib * MiB, max(MiB, total // 4))
    reps = 3 if args.quick or dry else 5
    cfg = {
        "backend": "host" if dry else "cuda",
        "device": "cpu" if dry else "cuda",
        "spec": gpu_model_spec(total),
        "bucket_bytes": bucket,
        "reps": reps,
        "deadline": args.sync_timeout,
        "timeout": 150.0 if args.quick or dry else 300.0,
    }
    steps = Steps()
    memcpy: float | None = None
    if dry:
        steps.claims.update({n: skipped(n, "cpu dry run") for n in GPU_ONLY})
    else:

        def copy_step() -> dict[str, Claim]:
            nonlocal memcpy
            memcpy = memcpy_gbps(total, reps)
            return {"device_memcpy_gbps": claim(memcpy, None, "GB/s")}

        steps.run(["device_memcpy_gbps"], copy_step)
    log(
        f"cuda ipc: {total / GiB:.2f} GiB in {bucket // MiB} MiB buckets, 2 processes, {cfg['backend']} slots"
    )
    steps.run([n for n in CLAIMS if n.startswith("cuda_ipc")], lambda: ipc_claims(cfg, memcpy, dry))
    log(f"worker ipc: WorkerWeights channel, 3 processes, endpoints {'/'.join(READERS)}")
    steps.run([n for n in CLAIMS if n.startswith("worker_ipc")], lambda: channel_claims(cfg, memcpy, dry))
    if not dry and memcpy is not None:
        log("nccl: one-rank communicator, real API and bucket loop; bounded init")
        steps.run([n for n in CLAIMS if n.startswith("nccl")], lambda: nccl_claims(cfg, memcpy or 1.0))
    log("offload: module, gradients and Adam state")
    steps.run([n for n in CLAIMS if n.startswith("offload")], lambda: offload_claims(dry, args.quick))
    signal.alarm(0)
    for name in CLAIMS:  # a claim no step produced (a step that never ran) is a miss, not absent
        steps.claims.setdefault(name, missed(name, "not run"))
    code = report({n: steps.claims[n] for n in CLAIMS}, args.json, title="gpu_check")
    for trace in steps.tracebacks:
        print(f"\n--- traceback: {trace}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
