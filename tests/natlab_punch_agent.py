"""One side of a hole punch, run inside a lab namespace by tests/test_nat_lab_punch.py.

It learns its server-reflexive address from the rendezvous's STUN port on the socket it will
punch from, prints its candidates as one JSON line, reads the peer's candidates and a start
delay as one JSON line, waits, punches, and prints the outcome as one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import sys
import time

from kafila.network.nat import reflexive_address
from kafila.network.punch import punch


def address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stun", required=True)
    parser.add_argument("--session", required=True)
    parser.add_argument("--timeout", type=float, default=5.0)
    args = parser.parse_args()
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("0.0.0.0", 0))
    server = address(args.stun)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect(server)
        host = (probe.getsockname()[0], sock.getsockname()[1])
    started = time.perf_counter()
    srflx = reflexive_address(sock, server)
    rtt = time.perf_counter() - started
    print(json.dumps({"candidates": [f"{h}:{p}" for h, p in (host, srflx)], "rtt_s": rtt}), flush=True)
    peer = json.loads(sys.stdin.readline())
    time.sleep(max(0.0, float(peer.get("delay_s", 0.0))))
    candidates = [address(c) for c in peer["candidates"]]
    result = asyncio.run(punch(sock, bytes.fromhex(args.session), candidates, timeout=args.timeout))
    path = f"{result.path[0]}:{result.path[1]}" if result.path else None
    print(json.dumps({"path": path, "seconds": result.seconds}), flush=True)


if __name__ == "__main__":
    main()
