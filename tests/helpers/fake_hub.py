"""A Hugging Face hub on a loopback socket, speaking the parts of its API huggingface_hub calls to
list a repository and download a file: `/api/models/{repo}/revision/{rev}?blobs=true`, and HEAD and
GET `/{repo}/resolve/{rev}/{file}` with X-Repo-Commit, X-Linked-Etag (the sha256 of an LFS file),
X-Linked-Size and Range (`bytes=A-` and `bytes=A-B`, answered 206 with Content-Range). A gated
repository answers a request without a token 401, as the hub does. It counts the bytes of file it
sent, per client (the Authorization header a client sends: a token each) and per file. It can cut a
GET off mid-way (per file, or per client), and send at most so many bytes a second, all clients
together, as a hub's one server would. Tests point HF_ENDPOINT (or `endpoint=`) at it.

`python tests/helpers/fake_hub.py --repo ORG/NAME FILE...` serves files from disk (mapped, not read
into memory) in a process of its own, as the stage delivery benchmark runs it in the NAT lab's
internet: it prints `READY <url>`, then answers each line on stdin with the bytes sent per client
(JSON), and ends at the end of stdin."""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import mmap
import re
import socket
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import unquote, urlsplit

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@dataclass
class Repo:
    files: dict[str, bytes]
    listed_sha256: dict[str, str] = field(default_factory=dict)  # a hash the listing claims instead of the true one
    gated: bool = False  # its files only to a client that sends a token


@dataclass
class FakeHub:
    repos: dict[str, Repo] = field(default_factory=dict)
    drop_after: dict[str, int] = field(default_factory=dict)  # file → bytes sent before the first GET is cut off
    # Authorization → bytes: that client's first GET answered with more than this many bytes is cut
    # off after them (its header fetches, shorter, pass)
    cut_for: dict[str | None, int] = field(default_factory=dict)
    rate_bytes_s: float = 0.0  # what the hub sends a second, every client together (0: no cap)
    seen: list[tuple[str, str, str | None]] = field(default_factory=list)  # (method, path, Range)
    authorizations: set[tuple[str, str | None]] = field(default_factory=set)  # (method path, Authorization)
    url: str = ""
    connections: set[socket.socket] = field(default_factory=set)  # open ones, closed when the hub stops
    sent_to: dict[str | None, int] = field(default_factory=dict)  # Authorization → bytes of files sent (written)
    sent_of: dict[str, int] = field(default_factory=dict)  # file → bytes of it sent
    ranges: bool = True  # False: a server that ignores Range and always sends the whole file (200)
    _digests: dict[tuple[str, str, str, int], str] = field(default_factory=dict)  # a large file hashed once
    _pace_lock: threading.Lock = field(default_factory=threading.Lock)
    _free_at: float = 0.0  # when the hub's rate has sent what it was given

    def ranges_of(self, filename: str) -> list[tuple[int, int]]:
        """The byte ranges [start, end) of every ranged GET of `filename` so far."""
        asked = []
        for r in self.gets_of(filename):
            if r is not None and (m := re.fullmatch(r"bytes=(\d+)-(\d*)", r)):
                size = len(next(repo.files[filename] for repo in self.repos.values() if filename in repo.files))
                asked.append((int(m[1]), int(m[2]) + 1 if m[2] else size))
        return asked

    def gets_of(self, filename: str) -> list[str | None]:
        """The Range header of every GET of `filename` so far (None: the whole file)."""
        return [
            r for method, path, r in self.seen if method == "GET" and path.endswith(f"/resolve/{COMMIT}/{filename}")
        ]

    def sha256(self, repo: str, filename: str) -> str:
        listed = self.repos[repo].listed_sha256.get(filename)
        return listed or self.digest(repo, filename, "sha256")

    def digest(self, repo: str, filename: str, algorithm: str) -> str:
        """The file's digest, computed once for as long as the same object stands there."""
        data = self.repos[repo].files[filename]
        key = (repo, filename, algorithm, id(data))
        if key not in self._digests:
            self._digests[key] = hashlib.new(algorithm, data).hexdigest()
        return self._digests[key]

    def paced(self, n_bytes: int) -> float:
        """How long to wait before sending `n_bytes` more at the hub's rate (0 with no cap)."""
        if self.rate_bytes_s <= 0:
            return 0.0
        with self._pace_lock:
            now = time.monotonic()
            start = max(now, self._free_at)
            self._free_at = start + n_bytes / self.rate_bytes_s
            return start - now


_PACED_CHUNK = 64 << 10  # what a hub with a rate sends at a time
_RESOLVE = re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<file>.+)$")
_INFO = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)(?:/revision/(?P<rev>[^/]+))?$")


def _handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def setup(self) -> None:
            super().setup()
            with lock:
                hub.connections.add(self.connection)

        def log_message(self, format: str, *args: object) -> None:
            return

        def _reply(
            self,
            status: int,
            body: bytes,
            headers: dict[str, str] | None = None,
            send: bool = True,
            file: str | None = None,
        ) -> None:
            self.send_response(status)
            for key, value in {"Content-Length": str(len(body)), **(headers or {})}.items():
                self.send_header(key, value)
            self.end_headers()
            if send:
                self._write(body, file)

        def _write(self, body: bytes, file: str | None = None) -> None:
            """`body` to the client, at the hub's rate where it has one; where it is of `file`, its
            bytes counted as they go (`sent_to`, `sent_of`): a client that closes the connection
            early is sent, and counted, no more."""
            view = memoryview(body)
            step = _PACED_CHUNK if hub.rate_bytes_s > 0 else max(1, len(view))
            for at in range(0, len(view), step):
                chunk = view[at : at + step]
                time.sleep(hub.paced(len(chunk)))
                try:
                    self.wfile.write(chunk)
                except (BrokenPipeError, ConnectionResetError):
                    self.close_connection = True
                    return
                if file is not None:
                    with lock:
                        who = self.headers.get("Authorization")
                        hub.sent_to[who] = hub.sent_to.get(who, 0) + len(chunk)
                        hub.sent_of[file] = hub.sent_of.get(file, 0) + len(chunk)

        def do_HEAD(self) -> None:
            self._resolve(send=False)

        def do_GET(self) -> None:
            path = unquote(urlsplit(self.path).path)
            with lock:
                hub.seen.append(("GET", path, self.headers.get("Range")))
                hub.authorizations.add((f"GET {path}", self.headers.get("Authorization")))
            info = _INFO.match(path)
            if info is not None:
                repo = hub.repos.get(info["repo"])
                if repo is None:
                    self._reply(404, b'{"error":"Repository not found"}', {"X-Error-Code": "RepoNotFound"})
                    return
                siblings = [
                    {
                        "rfilename": name,
                        "size": len(data),
                        "blobId": hub.digest(info["repo"], name, "sha1"),
                        "lfs": {"size": len(data), "sha256": hub.sha256(info["repo"], name), "pointerSize": 134},
                    }
                    for name, data in repo.files.items()
                ]
                body = json.dumps({"id": info["repo"], "modelId": info["repo"], "sha": COMMIT, "siblings": siblings})
                self._reply(200, body.encode(), {"Content-Type": "application/json"})
                return
            self._resolve(send=True)

        def _resolve(self, send: bool) -> None:
            path = unquote(urlsplit(self.path).path)
            if not send:
                with lock:
                    hub.seen.append(("HEAD", path, None))
                    hub.authorizations.add((f"HEAD {path}", self.headers.get("Authorization")))
            found = _RESOLVE.match(path)
            repo = hub.repos.get(found["repo"]) if found else None
            if found is None or repo is None or found["file"] not in repo.files:
                self._reply(404, b"not found", {"X-Error-Code": "EntryNotFound"}, send)
                return
            if repo.gated and not (self.headers.get("Authorization") or "").startswith("Bearer "):
                self._reply(401, b"gated", {"X-Error-Code": "GatedRepo", "X-Error-Message": "Access restricted"}, send)
                return
            data = repo.files[found["file"]]
            sha = hub.sha256(found["repo"], found["file"])
            headers = {
                "X-Repo-Commit": COMMIT,
                "X-Linked-Etag": f'"{sha}"',
                "X-Linked-Size": str(len(data)),
                "ETag": f'"{sha}"',
                "Content-Type": "application/octet-stream",
            }
            if hub.ranges:
                headers["Accept-Ranges"] = "bytes"
            status, body = 200, data
            asked = self.headers.get("Range") if hub.ranges else None
            if send and asked and (m := re.fullmatch(r"bytes=(\d+)-(\d*)", asked)):
                start, end = int(m[1]), min(int(m[2]) + 1 if m[2] else len(data), len(data))
                status, body = 206, data[start:end]
                headers["Content-Range"] = f"bytes {start}-{end - 1}/{len(data)}"
            with lock:
                cut = hub.drop_after.pop(found["file"], None) if send else None
                client = self.headers.get("Authorization")
                if send and cut is None and hub.cut_for.get(client, len(body)) < len(body):
                    cut = hub.cut_for.pop(client)
            if cut is None:
                self._reply(status, body, headers, send, found["file"])
                return
            self.send_response(status)  # the first GET: the whole length promised, then the connection drops
            for key, value in {"Content-Length": str(len(body)), **headers}.items():
                self.send_header(key, value)
            self.end_headers()
            self._write(body[:cut], found["file"])
            self.wfile.flush()
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)

    return Handler


class _HubServer(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that closes its connection early (a header read that stops where the header
        ends) is what the hub's clients do, not an error to print; anything else is."""
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


@contextmanager
def serving_hub(hub: FakeHub, address: str = "127.0.0.1", port: int = 0) -> Iterator[FakeHub]:
    """`hub` on `address` (a free port unless given), in a thread, for the block; its `url` set."""
    server = _HubServer((address, port), _handler(hub))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    hub.url = f"http://{address}:{server.server_address[1]}"
    try:
        yield hub
    finally:
        server.shutdown()
        server.server_close()
        for connection in list(hub.connections):  # a client's kept-alive connection ends too: the hub is gone
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)
        thread.join(timeout=10)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="a fake Hugging Face hub serving files from disk")
    parser.add_argument("--repo", required=True, help="the repository's ORG/NAME")
    parser.add_argument("files", nargs="+", help="files it holds, served under their own names")
    parser.add_argument("--address", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--rate-mb", type=float, default=0.0, help="MB a second, every client together (0: no cap)")
    args = parser.parse_args(argv)
    files: dict[str, bytes] = {}
    for path in args.files:
        with open(path, "rb") as file:
            files[path.rsplit("/", 1)[-1]] = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)  # type: ignore[assignment]
    hub = FakeHub({args.repo: Repo(files)}, rate_bytes_s=args.rate_mb * 1e6)
    for name in files:  # hashed before the first client asks (the listing names both), not while it waits
        hub.sha256(args.repo, name)
        hub.digest(args.repo, name, "sha1")
    with serving_hub(hub, args.address, args.port):
        print(f"READY {hub.url}", flush=True)
        for _ in sys.stdin:
            print(json.dumps(hub.sent_to), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
