"""Security properties across the packages and the demo.

- shared memory: random names, mode 0600, owned by us, never reused across runs; a reader maps
  only a segment that is ours with mode 0600; reclaiming dead segments never touches another
  user's files or a live creator's, whatever PID namespace it runs in;
- nothing decoded from a peer uses pickle: a source scan of weightsync and policygroup, and
  hypothesis fuzzing of every metadata decoder (malformed, oversized, deeply nested input ->
  MetadataError, never anything else);
- the demo's default runtime: Ray token authentication on (a wrong token is refused), every
  Ray server on loopback, Ray's IPC sockets under a directory only we can enter, and the
  segments a real PolicyGroup sync creates private.

Each test prints one line "SECURITY <check> | <outcome>" (the README table).
"""

from __future__ import annotations

import ast
import contextlib
import json
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlfleet.weightsync import (
    Layout,
    MetadataError,
    SharedBuffer,
    SharedBufferReader,
    SharedSegment,
    ShmRingReceiver,
    ShmRingSender,
    UnsafeSegmentError,
    WeightSyncError,
    cleanup_stale_segments,
)
from rlfleet.weightsync.protocol._wire import CONTROL_BYTES, HEADER_BYTES, Control, Header

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
NAME = re.compile(r"^(?P<prefix>rlfleet[A-Za-z0-9-]*)_(?P<pid>\d+)_(?P<start>\d+)_(?P<rand>[0-9a-f]{32})$")
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

pytestmark = pytest.mark.timeout(300)


def report(check: str, outcome: str) -> None:
    print(f"\nSECURITY {check} | {outcome}")


def small_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(64, 16, generator=g), "b": torch.randn(16, generator=g)}


# ------------------------------------------------------------------ shared memory
def _check_private(path: Path) -> None:
    st_ = path.lstat()
    assert stat.S_ISREG(st_.st_mode), path
    assert stat.S_IMODE(st_.st_mode) == 0o600, (path, oct(st_.st_mode))
    assert st_.st_uid == os.getuid()


def test_weightsync_segments_are_private_random_and_never_reused() -> None:
    layout = Layout.from_state_dict(small_state(), 4096)
    names = []
    with (
        SharedSegment.create(8192) as seg,
        ShmRingSender(layout, 1) as ring,
    ):
        shared = SharedBuffer(layout, 1)
        try:
            for name in (seg.name, ring.name, shared.name):
                _check_private(Path("/dev/shm") / name)
                match = NAME.match(name)
                assert match, name
                names.append(match["rand"])
        finally:
            shared.close()
    # another process makes its own: 128 fresh random bits per segment, never a reused name
    code = (
        "from rlfleet.weightsync import SharedSegment\nwith SharedSegment.create(4096) as s: print(s.name)\n"
    )
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        match = NAME.match(out.stdout.strip())
        assert match, out.stdout + out.stderr
        names.append(match["rand"])
        assert not (Path("/dev/shm") / out.stdout.strip()).exists()  # unlinked at exit
    assert len(set(names)) == len(names)
    report(
        "weightsync segments (SharedSegment, ShmRing, SharedBuffer)", "0600, ours, 128 random bits, unique"
    )


def test_attach_refuses_foreign_names_and_garbage_segments() -> None:
    for bad in ("../etc/passwd", "rlfleet", "rlfleet_1_2_xyz", "/dev/shm/x", "rlfleet_1_2_" + "0" * 31):
        with pytest.raises(ValueError, match="not an rlfleet shared-memory segment name"):
            SharedSegment.attach(bad)
    with SharedSegment.create(1 << 16) as seg:  # ours by name, garbage inside
        seg.tensor()[:] = torch.randint(0, 256, (1 << 16,), dtype=torch.uint8)
        with pytest.raises(WeightSyncError):
            ShmRingReceiver.attach(seg.name, 0)
        with pytest.raises(WeightSyncError):
            SharedBufferReader.attach(seg.name, timeout_s=0.5)
    report("attach to foreign names / garbage segments", "ValueError / WeightSyncError")


NOBODY = 65534  # another user (the tests run as root, which may chown)


def test_attach_maps_only_segments_private_to_us() -> None:
    """Names in /dev/shm are listable: once unlinked, anyone may create a file under a name."""
    layout = Layout.from_state_dict(small_state(), 4096)
    shared, ring, seg = SharedBuffer(layout, 1), ShmRingSender(layout, 1), SharedSegment.create(8192)
    with shared, ring, seg:
        readers = {
            shared.name: lambda n: SharedBufferReader.attach(n, timeout_s=5),
            ring.name: lambda n: ShmRingReceiver.attach(n, 0),
            seg.name: SharedSegment.attach,
        }
        refused = 0
        for name, attach in readers.items():
            path = Path("/dev/shm") / name
            for tamper in (lambda p: os.chmod(p, 0o640), lambda p: os.chown(p, NOBODY, NOBODY)):
                tamper(path)
                with pytest.raises(UnsafeSegmentError, match="not private to this user"):
                    attach(name)
                refused += 1
                os.chmod(path, 0o600)
                os.chown(path, os.getuid(), os.getgid())
    report("attach to a segment of another owner or mode", f"UnsafeSegmentError ({refused} of {refused})")


def test_reclaiming_dead_segments_spares_other_users_and_live_creators() -> None:
    if shutil.which("unshare") is None:
        pytest.skip("unshare(1) is not installed")
    prefix = "rlfleetsec"
    dead_theirs = Path("/dev/shm") / f"{prefix}_0_1_{os.urandom(16).hex()}"  # pid 0: never alive
    os.close(os.open(dead_theirs, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    os.chown(dead_theirs, NOBODY, NOBODY)
    unshare = ["unshare", "--pid", "--fork", "--kill-child", "--mount-proc"]
    creator = subprocess.Popen(  # alive, in another PID namespace
        [*unshare, sys.executable, "-c", _LIVE_CREATOR, prefix],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert creator.stdout is not None
        live = creator.stdout.readline().strip()
        if not live:
            pytest.skip(f"no PID namespace here: {creator.communicate(timeout=60)[1][:200]}")
        removed = cleanup_stale_segments(prefix)
        assert removed == []
        assert dead_theirs.exists()
        assert (Path("/dev/shm") / live).exists()
    finally:
        with contextlib.suppress(FileNotFoundError):
            dead_theirs.unlink()
        if creator.poll() is None:
            creator.communicate(input="done\n", timeout=60)  # it exits and unlinks its segment
    report(
        "reclaim of dead segments (cleanup_stale_segments)",
        "only this user's, never a live creator's (creator lock, any PID namespace)",
    )


_LIVE_CREATOR = """
import sys
from rlfleet.weightsync import SharedSegment
segment = SharedSegment.create(4096, prefix=sys.argv[1])
print(segment.name, flush=True)
sys.stdin.readline()
"""


# ------------------------------------------------------------------ no pickle on peer data
BANNED_IMPORTS = {"pickle", "cPickle", "cloudpickle", "dill", "marshal", "shelve", "joblib"}
BANNED_CALLS = {
    "broadcast_object_list",
    "all_gather_object",
    "gather_object",
    "scatter_object_list",
    "send_object_list",
    "recv_object_list",
    "eval",
    "exec",
}


def _violations(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            out += [
                f"{path.name}:{node.lineno} imports {m}" for m in mods if m.split(".")[0] in BANNED_IMPORTS
            ]
        if isinstance(node, ast.Call):
            fn = node.func
            name = fn.attr if isinstance(fn, ast.Attribute) else fn.id if isinstance(fn, ast.Name) else ""
            builtin = isinstance(fn, ast.Name)  # model.eval() is not eval()
            if name in BANNED_CALLS and (builtin or name not in ("eval", "exec")):
                out.append(f"{path.name}:{node.lineno} calls {name}")
            kw = {k.arg: k.value for k in node.keywords}
            if name == "load" and isinstance(fn, ast.Attribute) and getattr(fn.value, "id", "") == "torch":
                safe = kw.get("weights_only")
                if not (isinstance(safe, ast.Constant) and safe.value is True):
                    out.append(f"{path.name}:{node.lineno} torch.load without weights_only=True")
            allow = kw.get("allow_pickle")
            if name == "load" and isinstance(allow, ast.Constant) and allow.value is True:
                out.append(f"{path.name}:{node.lineno} numpy load with allow_pickle=True")
            owner = getattr(getattr(fn, "value", None), "id", "")
            if name in ("loads", "load") and owner == "yaml":
                out.append(f"{path.name}:{node.lineno} yaml.{name}")
    return out


def test_nothing_decoded_from_a_peer_uses_pickle() -> None:
    files = sorted((ROOT / "packages" / "weightsync" / "src").rglob("*.py")) + sorted(
        (ROOT / "packages" / "policygroup" / "src").rglob("*.py")
    )
    assert len(files) > 10
    problems = [v for f in files for v in _violations(f)]
    assert not problems, problems
    report(
        f"source scan of weightsync + policygroup ({len(files)} files)",
        "no pickle/object collectives/unsafe load",
    )


# ------------------------------------------------------------------ metadata fuzzing
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=10), children, max_size=5)
    ),
    max_leaves=30,
)


def _valid_layout() -> dict[str, Any]:
    return Layout.from_state_dict(small_state(), 1024).to_dict()


def _only_metadata_errors(fn: Any, raw: Any) -> None:
    """`fn(raw)` may accept the input or raise MetadataError; anything else fails the test."""
    with contextlib.suppress(MetadataError):
        fn(raw)


@FUZZ
@given(st.binary(max_size=2000))
def test_layout_from_json_random_bytes(raw: bytes) -> None:
    _only_metadata_errors(Layout.from_json, raw)


@FUZZ
@given(json_values)
def test_layout_from_json_random_json(value: Any) -> None:
    _only_metadata_errors(Layout.from_json, json.dumps(value))


@FUZZ
@given(st.sampled_from(["format", "bucket_bytes", "alignment", "tensors", "digest"]), json_values)
def test_layout_from_json_mutated_field(key: str, value: Any) -> None:
    data = _valid_layout()
    data[key] = value
    _only_metadata_errors(Layout.from_json, json.dumps(data))


@FUZZ
@given(st.integers(0, 6), json_values)
def test_layout_from_json_mutated_entry(position: int, value: Any) -> None:
    data = _valid_layout()
    if position < len(data["tensors"]):
        data["tensors"][position] = value
    else:
        data["tensors"].append(value)
    _only_metadata_errors(Layout.from_json, json.dumps(data))


@pytest.mark.parametrize(
    "raw",
    [
        b"[" * 100_000,
        b'{"a":' * 50_000,
        b"\xff\xfe\x00",
        b"1e999999",
        b'{"format":1,"alignment":512,"bucket_bytes":1024,"tensors":[["x",[1125899906842624,1048576],"float64"]],"digest":""}',
        json.dumps({**_valid_layout(), "tensors": [["x", [1] * 100, "float32"]]}).encode(),
        json.dumps({**_valid_layout(), "tensors": [["x" * 5000, [1], "float32"]]}).encode(),
        json.dumps({**_valid_layout(), "tensors": [["x", [1], "object"]]}).encode(),
    ],
)
def test_layout_from_json_hostile_inputs(raw: bytes) -> None:
    with pytest.raises(MetadataError):
        Layout.from_json(raw)


def test_layout_from_json_oversized_is_refused_before_parsing() -> None:
    with pytest.raises(MetadataError, match="over the"):
        Layout.from_json(b" " * 1025, max_bytes=1024)
    report(
        "Layout.from_json fuzz (bytes, JSON, mutated fields/entries, hostile, oversized)",
        "MetadataError only",
    )


def _frame(body: bytes, size: int) -> bytes:
    return body[:size] + b"\0" * max(0, size - len(body))


@FUZZ
@given(st.binary(max_size=HEADER_BYTES + 16))
def test_wire_header_random_bytes(raw: bytes) -> None:
    _only_metadata_errors(Header.decode, raw)
    _only_metadata_errors(Header.decode, _frame(raw, HEADER_BYTES))
    _only_metadata_errors(Control.decode, _frame(raw, CONTROL_BYTES))


@FUZZ
@given(json_values)
def test_wire_header_random_json(value: Any) -> None:
    body = json.dumps(value).encode()
    _only_metadata_errors(Header.decode, _frame(body, HEADER_BYTES))
    _only_metadata_errors(Control.decode, _frame(body, CONTROL_BYTES))


@FUZZ
@given(
    st.sampled_from(
        [
            "magic",
            "protocol",
            "version",
            "digest",
            "buckets",
            "checksums",
            "layout_nbytes",
            "direct_min",
            "abort",
        ]
    ),
    json_values,
)
def test_wire_header_mutated_field(key: str, value: Any) -> None:
    good = json.loads(Header(3, "ab" * 32, 4, True, 100).encode().rstrip(b"\0"))
    good[key] = value
    body = json.dumps(good).encode()
    if len(body) <= HEADER_BYTES:
        _only_metadata_errors(Header.decode, _frame(body, HEADER_BYTES))


@pytest.mark.parametrize("nest", [b"[", b'{"a":'])
def test_wire_frames_nested_too_deeply(nest: bytes) -> None:
    with pytest.raises(MetadataError):
        Header.decode(_frame(nest * HEADER_BYTES, HEADER_BYTES))
    with pytest.raises(MetadataError):
        Control.decode(_frame(nest * CONTROL_BYTES, CONTROL_BYTES))
    with pytest.raises(MetadataError, match="expected"):
        Header.decode(b"{}" * (HEADER_BYTES * 4))  # oversized frame
    report("wire header / control word fuzz (bytes, JSON, mutated, nested, oversized)", "MetadataError only")


def test_other_peer_metadata_decoders_are_fuzz_clean() -> None:
    from rlfleet.weightsync.cuda._cuda_ipc import _decode_meta
    from rlfleet.weightsync.cuda._nccl import decode_unique_id

    hostile: list[Any] = [b"[" * 50_000, b"{}", b"\xff", b'{"b64":"!!"}', b'{"ints":[1]}', b"null", b"1e9999"]
    for raw in hostile:
        _only_metadata_errors(decode_unique_id, raw)
        _only_metadata_errors(_decode_meta, raw)
    report("NCCL unique id / CUDA-IPC channel metadata decoders", "MetadataError only")


def test_reshard_metadata_decoders_reject_nested_json() -> None:
    from rlfleet.weightsync.reshard._reshard import RankProgram, _decode_header

    for fn in (RankProgram.coerce, _decode_header):
        with pytest.raises(MetadataError):
            fn(b"[" * 50_000)


# ------------------------------------------------------------------ the demo's runtime
@pytest.fixture(scope="module")
def demo_runtime() -> dict[str, Any]:
    """The demo's default single-node runtime with a real group sync, probed in a subprocess."""
    proc = subprocess.run(
        [sys.executable, str(HERE / "security_probe.py")],
        capture_output=True,
        text=True,
        timeout=280,
        env={k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")},
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("REPORT ")]
    assert lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    data: dict[str, Any] = json.loads(lines[-1][len("REPORT ") :])
    return data


LOOPBACK = ("127.0.0.1", "::1", "::ffff:127.0.0.1")


@pytest.mark.timeout(300)
def test_demo_keeps_token_authentication_on(demo_runtime: dict[str, Any]) -> None:
    assert demo_runtime["env_auth_mode"] == "token"
    assert demo_runtime["token_auth"] is True
    wrong = demo_runtime["wrong_token"]
    assert not wrong["connected"], wrong
    assert wrong["rc"] not in (0, None), wrong
    token = Path.home() / ".ray" / "auth_token"
    if token.exists():
        assert stat.S_IMODE(token.stat().st_mode) & 0o077 == 0, oct(token.stat().st_mode)
    report("demo: Ray token authentication", "on; a client with a wrong token is refused; token file 0600")


@pytest.mark.timeout(300)
def test_demo_ray_listens_on_loopback_only(demo_runtime: dict[str, Any]) -> None:
    assert demo_runtime["gcs_address"].startswith("127.0.0.1:")
    assert demo_runtime["node_ip"] == "127.0.0.1"
    exposed = [lis for lis in demo_runtime["listeners"] if lis["ip"] not in LOOPBACK]
    assert demo_runtime["listeners"]
    assert not exposed, exposed
    report(
        "demo: Ray servers, workers, gloo, rendezvous store",
        f"{len(demo_runtime['listeners'])} listening sockets, all on loopback",
    )


@pytest.mark.timeout(300)
def test_demo_rendezvous_store_listens_on_loopback_only(demo_runtime: dict[str, Any]) -> None:
    stores = set(demo_runtime["store_ports"])
    assert stores
    seen = [lis for lis in demo_runtime["listeners"] if lis["port"] in stores]
    assert seen, "the rendezvous stores were not listening while the groups ran"
    exposed = [lis for lis in seen if lis["ip"] not in LOOPBACK]
    assert not exposed, exposed
    report("demo: rendezvous stores (rank 0 of each world)", f"{len(seen)} listening, on loopback only")


@pytest.mark.timeout(300)
def test_demo_ipc_sockets_are_not_reachable_by_other_users(demo_runtime: dict[str, Any]) -> None:
    chain = demo_runtime["socket_dirs"]
    guard = [d for d in chain if d["uid"] == demo_runtime["uid"] and d["mode"] & 0o077 == 0]
    assert guard, chain  # a directory on the way that only we can enter
    report("demo: Ray IPC sockets", f"under {guard[0]['path']} (mode {guard[0]['mode']:o})")


@pytest.mark.timeout(300)
def test_policy_group_segments_are_private_and_unlinked(demo_runtime: dict[str, Any]) -> None:
    shm = demo_runtime["shm"]
    assert shm["Double"], shm
    assert shm["Shared"], shm
    for entries in shm.values():
        for name, info in entries.items():
            assert info["regular"], name
            assert info["mode"] == 0o600, (name, info)
            assert info["uid"] == demo_runtime["uid"], (name, info)
            assert info["creator_locked"], (name, info)  # a reclaim from any PID namespace spares it
    assert not demo_runtime["shm_after"], demo_runtime["shm_after"]
    names = [n for entries in shm.values() for n in entries]
    assert len(set(names)) == len(names)
    report(
        "policy group node buffers (Double copies out, Shared binds)",
        "0600, ours, creator-locked while live, unlinked at shutdown",
    )
