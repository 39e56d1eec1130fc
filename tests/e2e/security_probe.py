"""Run the demo's default Ray runtime with a small policy group and report what it exposes (JSON).

Used by test_security.py in a subprocess (it starts and stops its own Ray): whether token
authentication is on, which TCP addresses the Ray processes and our workers listen on, the
mode of Ray's IPC socket directories, the shared-memory files a Double and a Shared sync
create (name, mode, owner, whether their creator holds its lifetime lock), and whether a client
with a wrong token is refused.
"""

from __future__ import annotations

import fcntl
import json
import os
import stat
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil

HERE = Path(__file__).resolve().parent
EXAMPLES = HERE.parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))
sys.path.insert(0, str(HERE))


def listeners(root: int) -> list[dict[str, Any]]:
    """Listening TCP sockets of `root` and every process under it."""
    procs = [psutil.Process(root), *psutil.Process(root).children(recursive=True)]
    pids = {p.pid: p for p in procs}
    out = []
    for conn in psutil.net_connections(kind="inet"):
        if conn.status == psutil.CONN_LISTEN and conn.pid in pids:
            try:
                name = pids[conn.pid].name()
            except psutil.Error:
                name = "?"
            out.append({"ip": conn.laddr.ip, "port": conn.laddr.port, "pid": conn.pid, "proc": name})
    return out


def creator_locked(path: Path) -> bool:
    """Whether some process holds a lock on the segment's first byte (its creator's lifetime lock)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        query = struct.pack("hhqqi4x", fcntl.F_WRLCK, os.SEEK_SET, 0, 1, 0)
        answer = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, query)
        return struct.unpack("hhqqi4x", answer)[0] != fcntl.F_UNLCK
    finally:
        os.close(fd)


def shm_entries() -> dict[str, dict[str, Any]]:
    out = {}
    for entry in Path("/dev/shm").iterdir():
        if not entry.name.startswith("rlfleet"):
            continue
        try:
            st = entry.lstat()
        except FileNotFoundError:
            continue
        out[entry.name] = {
            "mode": stat.S_IMODE(st.st_mode),
            "uid": st.st_uid,
            "regular": stat.S_ISREG(st.st_mode),
            "creator_locked": creator_locked(entry),
        }
    return out


def socket_dirs(session_dir: str) -> list[dict[str, Any]]:
    """Mode of every directory from / down to Ray's socket directory (who can reach it)."""
    out = []
    path = Path(session_dir) / "sockets"
    for p in [path, *path.parents]:
        st = p.stat()
        out.append({"path": str(p), "mode": stat.S_IMODE(st.st_mode), "uid": st.st_uid})
    return out


def wrong_token_client(gcs: str) -> dict[str, Any]:
    env = dict(os.environ, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN="0" * 64)
    env.pop("RAY_AUTH_TOKEN_PATH", None)
    code = (
        "import ray, sys\n"
        f"ray.init(address={gcs!r}, log_to_driver=False)\n"
        "print('CONNECTED', ray.cluster_resources())\n"
    )
    start = time.monotonic()
    try:
        proc = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
        )
        rc, text = proc.returncode, (proc.stdout + proc.stderr)
    except subprocess.TimeoutExpired as exc:
        rc, text = None, f"timed out: {exc}"
    return {"rc": rc, "connected": "CONNECTED" in text, "tail": text[-1500:], "s": time.monotonic() - start}


def main() -> None:
    import argparse

    import cartpole_rl
    import fault_policies
    import ray
    from ray._private.authentication.authentication_utils import is_token_auth_enabled

    from rlfleet.policygroup import PolicyConfig, WeightBufferConfig, build_policy_group

    args = cartpole_rl.parse_args(["--no-progress"])
    assert isinstance(args, argparse.Namespace)
    report: dict[str, Any] = {"env_auth_mode": None}
    uids: list[str] = []
    with cartpole_rl.ray_runtime(args):
        ray.cloudpickle.register_pickle_by_value(fault_policies)
        report["env_auth_mode"] = os.environ.get("RAY_AUTH_MODE")
        report["token_auth"] = bool(is_token_auth_enabled())
        ctx = ray.get_runtime_context()
        report["gcs_address"] = ctx.gcs_address
        report["node_ip"] = ray.util.get_node_ip_address()
        session_dir = ray._private.worker._global_node.get_session_dir_path()
        report["socket_dirs"] = socket_dirs(session_dir)
        report["shm"] = {}
        for strategy, kind in (("Double", "WeightBuffer"), ("Shared", "CPUWeightBuffer")):
            config = PolicyConfig(
                weight_buffer=WeightBufferConfig(type=kind, buffer_strategy=strategy, bucket_bytes=1024),
                group_timeout_s=20.0,
                sync_timeout_s=30.0,
                rpc_timeout_s=60.0,
            )
            group = build_policy_group(fault_policies.FaultPolicy, 1, 2, config)
            try:
                group.train(None, seed=1)
                group.sync_weights()
                assert group.verify_eval_weight_checksums()
                ours = f"rlfleet-{group._uid}"  # other runs on this machine make segments too
                report["shm"][strategy] = {k: v for k, v in shm_entries().items() if k.startswith(ours)}
                uids.append(ours)
                report.setdefault("listeners", []).extend(listeners(os.getpid()))
                ports = ray.get([p.get_store_port.remote() for p in group.train_list + group.eval_list])
                report.setdefault("store_ports", []).extend(p for p in ports if p)
            finally:
                group.shutdown()
        report["shm_after"] = sorted(k for k in shm_entries() if k.startswith(tuple(uids)))
        report["wrong_token"] = wrong_token_client(report["gcs_address"])
    report["uid"] = os.getuid()
    print("REPORT " + json.dumps(report))


if __name__ == "__main__":
    main()
