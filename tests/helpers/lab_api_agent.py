"""A client of a `kafila host` inside a NAT lab namespace, driven from outside it.

`kafila host` serves its API on localhost of its own namespace; the tests and the WAN benchmark
run in another. This agent runs in the host's namespace (`NatLab.run`) with the official
`openai` client, takes one JSON request a line on stdin and answers one JSON line on stdout:

    {"op": "status"}                                     → /status
    {"op": "chat", "messages": [...], "max_tokens": 8}   → {"text", "ttft_s", "seconds", "tokens"}
    {"op": "completions", "prompts": [...], "max_tokens": 16, "stream": true, "temperature": 0, "seed": null}
        → every prompt at once, each in its own thread: [{"text", "finish", "ttft_s", "seconds", "tokens"}]
    {"op": "start", "id": "a", "messages": [...], "max_tokens": 200}  → a stream in the background
    {"op": "progress", "id": "a"}  → {"chunks", "done"}
    {"op": "result", "id": "a", "timeout": 60}  → {"text", "error", "error_at", "chunks", "longest_gap_s"}

Times are `time.time()`, comparable with the caller's clock (one machine, many namespaces).
"""

from __future__ import annotations

import json
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, cast
from urllib.request import urlopen

import openai


@dataclass(frozen=True)
class Api:
    base_url: str
    client: openai.OpenAI
    model: str  # the one model the host serves (its /v1/models id)


class _Stream:
    def __init__(self, api: Api, messages: list[dict[str, str]], max_tokens: int) -> None:
        self.chunks = 0
        self.text = ""
        self.longest_gap_s = 0.0  # between two chunks: what a member's loss costs a stream that goes on
        self.error: str | None = None
        self.error_at: float | None = None
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(api, messages, max_tokens), daemon=True)
        self.thread.start()

    def _run(self, api: Api, messages: list[dict[str, str]], max_tokens: int) -> None:
        try:
            stream = api.client.chat.completions.create(
                model=api.model, messages=cast(Any, messages), max_tokens=max_tokens, temperature=0, stream=True
            )
            last = None
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    now = time.monotonic()
                    if last is not None:
                        self.longest_gap_s = max(self.longest_gap_s, now - last)
                    last = now
                    self.text += chunk.choices[0].delta.content
                    self.chunks += 1
        except Exception as error:
            self.error, self.error_at = f"{type(error).__name__}: {error}", time.time()
        finally:
            self.done.set()


def completion(
    api: Api, prompt: str, max_tokens: int, stream: bool, temperature: float = 0.0, seed: int | None = None
) -> dict[str, Any]:
    started = time.time()
    if not stream:
        whole = api.client.completions.create(
            model=api.model, prompt=prompt, max_tokens=max_tokens, temperature=temperature, seed=seed
        )
        tokens = whole.usage.completion_tokens if whole.usage else -1
        return {"text": whole.choices[0].text, "finish": whole.choices[0].finish_reason, "ttft_s": None,
                "seconds": time.time() - started, "tokens": tokens}  # fmt: skip
    first: float | None = None
    text, finish, tokens = "", None, -1
    for chunk in api.client.completions.create(
        model=api.model, prompt=prompt, max_tokens=max_tokens, temperature=temperature, seed=seed, stream=True,
        stream_options={"include_usage": True},
    ):  # fmt: skip
        if chunk.choices and chunk.choices[0].text:
            first = first if first is not None else time.time()
            text += chunk.choices[0].text
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
        if chunk.usage:
            tokens = chunk.usage.completion_tokens
    ended = time.time()
    return {"text": text, "finish": finish, "ttft_s": None if first is None else first - started,
            "seconds": ended - started, "tokens": tokens}  # fmt: skip


def handle(api: Api, streams: dict[str, _Stream], request: dict[str, Any]) -> Any:
    op = request["op"]
    if op == "status":
        with urlopen(f"{api.base_url}/status", timeout=10) as response:
            return json.loads(response.read())
    if op == "chat":
        started = time.time()
        reply = api.client.chat.completions.create(
            model=api.model, messages=cast(Any, request["messages"]), max_tokens=request["max_tokens"], temperature=0
        )
        return {"text": reply.choices[0].message.content, "seconds": time.time() - started,
                "tokens": reply.usage.completion_tokens if reply.usage else -1}  # fmt: skip
    if op == "completions":
        results: list[Any] = [None] * len(request["prompts"])

        def run(index: int, prompt: str) -> None:
            try:
                results[index] = completion(
                    api, prompt, request["max_tokens"], request.get("stream", True), request.get("temperature", 0.0),
                    request.get("seed"),
                )  # fmt: skip
            except Exception as error:
                results[index] = {"error": f"{type(error).__name__}: {error}"}

        threads = [threading.Thread(target=run, args=pair) for pair in enumerate(request["prompts"])]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return results
    if op == "start":
        streams[request["id"]] = _Stream(api, request["messages"], request["max_tokens"])
        return {"started": time.time()}
    if op == "progress":
        stream = streams[request["id"]]
        return {"chunks": stream.chunks, "done": stream.done.is_set()}
    if op == "result":
        stream = streams[request["id"]]
        stream.done.wait(request.get("timeout", 120))
        return {"text": stream.text, "error": stream.error, "error_at": stream.error_at, "chunks": stream.chunks,
                "longest_gap_s": stream.longest_gap_s,
                "done": stream.done.is_set()}  # fmt: skip
    raise ValueError(f"unknown op {op!r}")


def main() -> None:
    base_url = sys.argv[1]
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=120)
    api = Api(base_url, client, sys.argv[2])
    streams: dict[str, _Stream] = {}
    for line in sys.stdin:
        try:
            answer = {"ok": handle(api, streams, json.loads(line))}
        except Exception as error:  # the caller decides what a failure means
            answer = {"error": f"{type(error).__name__}: {error}"}
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
