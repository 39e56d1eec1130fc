"""A co-located engine's end of the refit control channel, as a separate process.

``python zmq_peer.py ADDRESS MODE...``: connects a REP socket to ADDRESS and answers one request
per MODE: "hello" (a JSON handshake that echoes the request), "pickle" (a pickled reply),
"multi" (two frames), "array" (a JSON array, not an object), "silent" (no reply at all).
Prints one JSON line per request received.
"""

from __future__ import annotations

import json
import pickle
import sys

import zmq


def main(address: str, modes: list[str]) -> None:
    context = zmq.Context()
    socket = context.socket(zmq.REP)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(address)
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
            socket = context.socket(zmq.REP)
            socket.setsockopt(zmq.LINGER, 0)
            socket.connect(address)
    socket.close(linger=0)
    context.term()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
