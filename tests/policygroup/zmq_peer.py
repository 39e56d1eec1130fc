"""A co-located engine's end of the refit control channel, as a separate process.

``python zmq_peer.py ADDRESS MODE...``: connects a REP socket to ADDRESS and answers one request
per MODE: "hello" (a JSON handshake that echoes the request), "pickle" (a pickled reply),
"multi" (two frames), "array" (a JSON array, not an object), "silent" (no reply at all).
Prints one JSON line per request received. For a loopback (``tcp://``) channel, the path of its
credentials file (``RefitChannel.credentials``) comes in ``REFIT_CREDENTIALS``: the peer is then
the CURVE server the worker trusts, as an engine would be.
"""

from __future__ import annotations

import json
import os
import pickle
import sys
from typing import Any

import zmq


def rep_socket(context: Any, address: str) -> Any:
    socket = context.socket(zmq.REP)
    socket.setsockopt(zmq.LINGER, 0)
    credentials = os.environ.get("REFIT_CREDENTIALS")
    if credentials:
        with open(credentials) as keys_file:
            keys = json.load(keys_file)
        socket.curve_server = True
        socket.curve_publickey = keys["server_public"].encode()
        socket.curve_secretkey = keys["server_secret"].encode()
    socket.connect(address)
    return socket


def main(address: str, modes: list[str]) -> None:
    context = zmq.Context()
    socket = rep_socket(context, address)
    for mode in modes:
        if not socket.poll(60_000):
            raise TimeoutError("no request within 60 s")
        request = json.loads(socket.recv())  # the worker sends JSON only: anything else fails here
        print(json.dumps({"mode": mode, "request": request}), flush=True)
        if mode == "hello":
            socket.send_json({"type": "hello", "engine": "peer", "echo": request})
        elif mode == "pickle":
            socket.send(pickle.dumps({"type": "hello"}))
        elif mode == "multi":
            socket.send_multipart([b'{"type":"hello"}', b"{}"])
        elif mode == "array":
            socket.send(b"[1, 2]")
        elif mode == "silent":
            socket.close(linger=0)  # a REP socket must answer before it can read again
            socket = rep_socket(context, address)
    socket.close(linger=0)
    context.term()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
