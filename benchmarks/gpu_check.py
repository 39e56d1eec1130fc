"""GPU check of the weightsync GPU transports, in one call: CUDA IPC, NCCL, device memcpy.

Run: hatch run python benchmarks/gpu_check.py [--quick] [--json PATH] [--gib N]

On a CUDA machine (with CuPy: the ``[cuda12]`` / ``[cuda13]`` extra):
  memcpy     device-to-device copy of the same bytes (torch), the reference bandwidth;
  cuda ipc   two processes, `CudaIpcSender` -> `CudaIpcReceiver`: the sender packs each bucket
             into one of two GPU slots shared through cudaIpc handles (opened once), the reader
             applies it into its live GPU tensors ("None" in place); bytes / sync time, and the
             reader's weights compared bit for bit with what the sender sent;
  nccl       a one-rank NcclCommunicator (CuPy) running the real API and bucket loop
             (`NcclSender`: header, negotiation, control words, double-buffered buckets, commit):
             measures the protocol's own overhead on the GPU (one rank moves no bytes between GPUs).
Prints bandwidths and ratios against memcpy. Every step has a timeout and prints progress; the
whole script is bounded by an alarm. Without CUDA (or CuPy) it says so, exits 0, and writes its
claims marked skipped. ``--cpu-dry-run`` runs the IPC part with host slots on the CPU, to check
the script itself on a machine without a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Mapping
from typing import Any

from _state import GiB, MiB, build_state, gpu_model_spec

CLAIMS = {
    "cuda_ipc_over_memcpy": (0.4, "x"),
    "nccl_loop_over_memcpy": (None, "x"),
}


def log(msg: str) -> None:
    print(f"[gpu_check {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _claim(
    value: float | None, target: float | None, unit: str, skipped: str | None = None
) -> dict[str, Any]:
    out: dict[str, Any] = {
        "value": None if value is None else round(value, 4),
        "target": target,
        "unit": unit,
        "ok": True if skipped or target is None else bool(value is not None and value >= target),
    }
    if skipped:
        out["skipped"] = skipped
    return out


def skipped_claims(reason: str) -> dict[str, dict[str, Any]]:
    return {name: _claim(None, target, unit, skipped=reason) for name, (target, unit) in CLAIMS.items()}


# -- model ---------------------------------------------------------------------------------------
class InPlace:
    """Strategy "None" written in place: each bucket copied into the live tensors as it arrives."""

    def __init__(self, live: Mapping[str, Any], layout: Any) -> None:
        self.live = live
        self._layout = layout
        self._version = -1

    @property
    def layout(self) -> Any:
        return self._layout

    @property
    def version(self) -> int:
        return self._version

    def begin(self, version: int) -> None:
        if version <= self._version:
            from rlfleet.weightsync import VersionError

            raise VersionError(f"version {version} is not newer than {self._version}")

    def consume(self, index: int, data: Any) -> None:
        from rlfleet.weightsync import unpack_bucket_into

        unpack_bucket_into(self._layout, index, data, self.live)

    def commit(self, version: int) -> None:
        self._version = version

    def abort(self, error: BaseException) -> None:
        pass


# -- memcpy ----------------------------------------------------------------------------------------
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


# -- CUDA IPC across two processes -----------------------------------------------------------------
def _ipc_proc(role: str, cfg: dict[str, Any], path: str, queue: Any) -> None:
    try:
        queue.put((role, "ok", _ipc_body(role, cfg, path)))
    except BaseException as exc:
        queue.put((role, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    queue.close()
    queue.join_thread()
    os._exit(0)


def _ipc_body(role: str, cfg: dict[str, Any], path: str) -> dict[str, Any]:
    import torch

    from rlfleet.weightsync import CudaIpcReceiver, CudaIpcSender, Layout

    backend, device = cfg["backend"], cfg["device"]
    if device == "cuda":
        torch.cuda.set_device(0)
    spec = [(n, tuple(s), d) for n, s, d in cfg["spec"]]
    versions = cfg["versions"]
    deadline = cfg["deadline"]
    if role == "sender":
        states = [build_state(spec, seed=v, device=device) for v in (1, 2)]
        layout = Layout.from_state_dict(states[0], cfg["bucket_bytes"])
        with CudaIpcSender(layout, 1, backend=backend) as sender:
            tmp = path + ".tmp"
            with open(tmp, "w") as fh:
                fh.write(sender.name)
            os.replace(tmp, path)
            times = []
            for v in range(1, versions + 1):
                t0 = time.perf_counter()
                sender.send(states[(v - 1) % 2], v, deadline)
                times.append(time.perf_counter() - t0)
            return {"times": times, "bytes": layout.padded_bytes, "tensor_bytes": layout.total_bytes}
    end = time.monotonic() + 120
    while not os.path.exists(path):
        if time.monotonic() > end:
            raise TimeoutError("the sender never published its channel name")
        time.sleep(0.01)
    with open(path) as fh:
        name = fh.read()
    live = build_state(spec, fill=False, device=device)
    layout = Layout.from_state_dict(live, cfg["bucket_bytes"])
    consumer = InPlace(live, layout)
    with CudaIpcReceiver.attach(name, 0) as receiver:
        for _ in range(versions):
            receiver.receive(consumer, deadline)
    if device == "cuda":
        torch.cuda.synchronize()
    expected = build_state(spec, seed=(versions - 1) % 2 + 1, device=device)
    bad = [
        n
        for n in expected
        if not torch.equal(expected[n].view(-1).view(torch.uint8), live[n].view(-1).view(torch.uint8))
    ]
    return {"version": consumer.version, "mismatched": bad[:5], "n_mismatched": len(bad)}


def run_ipc(cfg: dict[str, Any], timeout: float) -> dict[str, Any]:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    path = os.path.join(tempfile.mkdtemp(prefix="rlfleet-gpucheck-"), "channel")
    procs = {
        r: ctx.Process(target=_ipc_proc, args=(r, cfg, path, queue), daemon=True)
        for r in ("sender", "reader")
    }
    for p in procs.values():
        p.start()
    results: dict[str, Any] = {}
    end = time.monotonic() + timeout
    try:
        while len(results) < 2:
            left = end - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"CUDA IPC processes did not finish within {timeout:.0f}s")
            try:
                role, status, value = queue.get(timeout=min(1.0, left))
            except Exception:
                dead = [r for r, p in procs.items() if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"CUDA IPC {dead[0]} died (exit {procs[dead[0]].exitcode})") from None
                continue
            if status != "ok":
                raise RuntimeError(f"CUDA IPC {role} failed:\n{value}")
            results[role] = value
            log(f"cuda ipc: {role} finished")
    finally:
        for p in procs.values():
            p.join(5)
            if p.is_alive():
                p.kill()
    return results


# -- NCCL, one rank --------------------------------------------------------------------------------
def nccl_loop(
    spec: list[tuple[str, tuple[int, ...], str]], bucket: int, reps: int, deadline: float
) -> dict[str, Any]:
    import torch

    from rlfleet.weightsync import Layout, NcclSender, NcclWire

    store = torch.distributed.HashStore()
    wire = NcclWire.create(store, 0, 1, deadline=60.0)
    try:
        sd = build_state(spec, seed=1, device="cuda")
        layout = Layout.from_state_dict(sd, bucket)
        sender = NcclSender(layout, wire)
        # force the packing path for every tensor too: direct sends would skip the copies
        packed = NcclSender(layout, wire, direct_min=1 << 62)
        out: dict[str, Any] = {}
        for label, s in (("direct", sender), ("packed", packed)):
            s.send(sd, 0, deadline)
            times = []
            for v in range(1, reps + 1):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                s.send(sd, v, deadline)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            out[label] = layout.total_bytes / statistics.median(times) / 1e9
        return out
    finally:
        wire.close()


# -- main ------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="1 GiB instead of 4 GiB, fewer repeats")
    ap.add_argument("--json", metavar="PATH", help="write the claims as JSON here")
    ap.add_argument("--gib", type=float, default=0.0, help="state dict size in GiB (default 1 quick, 4 full)")
    ap.add_argument("--bucket-mib", type=int, default=512)
    ap.add_argument("--cpu-dry-run", action="store_true", help="IPC part with host slots on CPU (no GPU)")
    ap.add_argument("--alarm", type=int, default=540, help="hard limit for the whole script, seconds")
    args = ap.parse_args(argv)

    def write(claims: dict[str, Any]) -> None:
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(claims, fh, indent=2)

    signal.signal(signal.SIGALRM, lambda *_: (_ for _ in ()).throw(TimeoutError("gpu_check alarm")))
    signal.alarm(args.alarm)
    try:
        import torch
    except ImportError:
        log("torch is not installed: skipped")
        write(skipped_claims("torch missing"))
        return 0
    dry = args.cpu_dry_run
    if not dry and not torch.cuda.is_available():
        log("no CUDA device visible to torch: GPU checks skipped (exit 0)")
        write(skipped_claims("no CUDA device"))
        return 0
    if not dry:
        try:
            import cupy  # noqa: F401
        except ImportError:
            log("CuPy is not installed (pip install 'rlfleet-weightsync[cuda12]' or '[cuda13]'): skipped")
            write(skipped_claims("cupy missing"))
            return 0
        log(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    total = int((args.gib or (0.0625 if dry else (1 if args.quick else 4))) * GiB)
    bucket = min(args.bucket_mib * MiB, max(MiB, total // 4))
    spec = gpu_model_spec(total)
    reps = 3 if args.quick or dry else 5
    claims: dict[str, Any] = {}
    rows: list[tuple[str, float]] = []

    copy_gbps: float | None = None
    if not dry:
        log(f"memcpy: {total / GiB:.2f} GiB device-to-device")
        copy_gbps = memcpy_gbps(total, reps)
        rows.append(("memcpy (d2d)", copy_gbps))

    log(f"cuda ipc: {total / GiB:.2f} GiB in {bucket // MiB} MiB buckets, {reps + 1} versions, 2 processes")
    cfg = {
        "backend": "host" if dry else "cuda",
        "device": "cpu" if dry else "cuda",
        "spec": spec,
        "bucket_bytes": bucket,
        "versions": reps + 1,
        "deadline": 120.0,
    }
    ipc_gbps: float | None = None
    try:
        res = run_ipc(cfg, timeout=300)
        times = res["sender"]["times"][1:]  # the first sync pays first-touch costs
        ipc_gbps = res["sender"]["tensor_bytes"] / statistics.median(times) / 1e9
        ok_bits = res["reader"]["n_mismatched"] == 0 and res["reader"]["version"] == reps + 1
        rows.append(("cuda ipc sync", ipc_gbps))
        log(f"cuda ipc: {ipc_gbps:.1f} GB/s, reader bit-exact: {ok_bits} {res['reader']['mismatched']}")
        claims["cuda_ipc_bit_exact"] = {"value": ok_bits, "target": True, "unit": "", "ok": ok_bits}
    except Exception as exc:
        log(f"cuda ipc FAILED: {exc}")
        claims["cuda_ipc_error"] = {"value": str(exc)[:500], "target": None, "unit": "", "ok": False}

    nccl: dict[str, float] = {}
    if not dry:
        log("nccl: one-rank communicator, real API and bucket loop")
        try:
            nccl = nccl_loop(spec, bucket, reps, 120.0)
            rows.append(("nccl loop, large tensors in place", nccl["direct"]))
            rows.append(("nccl loop, everything packed", nccl["packed"]))
        except Exception as exc:
            log(f"nccl FAILED: {exc}")
            claims["nccl_error"] = {"value": str(exc)[:500], "target": None, "unit": "", "ok": False}

    print(f"\n{'path':36s} {'GB/s':>9s} {'x memcpy':>9s}")
    for label, gbps in rows:
        ratio = f"{gbps / copy_gbps:9.3f}" if copy_gbps else f"{'-':>9s}"
        print(f"{label:36s} {gbps:9.1f} {ratio}")
    if copy_gbps and ipc_gbps:
        claims["cuda_ipc_over_memcpy"] = _claim(ipc_gbps / copy_gbps, *CLAIMS["cuda_ipc_over_memcpy"])
    elif dry:
        claims["cuda_ipc_over_memcpy"] = _claim(None, 0.4, "x", skipped="cpu dry run")
    else:  # the IPC run failed (see cuda_ipc_error): the claim is a miss, not absent
        claims["cuda_ipc_over_memcpy"] = _claim(None, *CLAIMS["cuda_ipc_over_memcpy"])
    if copy_gbps and nccl:
        claims["nccl_loop_over_memcpy"] = _claim(nccl["packed"] / copy_gbps, *CLAIMS["nccl_loop_over_memcpy"])
    for name, c in claims.items():
        print(
            f"  {name:28s} {c['value']!s:>10} target {c['target']} {c['unit']} {'ok' if c['ok'] else 'MISS'}"
        )
    write(claims)
    signal.alarm(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
