"""A hostile rendezvous floods a client: its memory stays bounded, and what it keeps is only what
a member of the session sent or what the client asked for.

The rendezvous here is a real WebSocket server that answers `open` properly, then sends what a
malicious operator could: refusals of every size, signals from peer ids that are no member,
pongs for pings never sent, members past the session's size, leaves of members never seen.
"""

from __future__ import annotations

import asyncio
import json
import tracemalloc
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import websockets
from waiting import until_async
from websockets.asyncio.server import ServerConnection

from kafila.contracts import MAX_MEMBERS, FleetDevice
from kafila.network.rendezvous import MAX_ERROR_MESSAGE, MAX_SIGNAL_BODY, Error, MemberInfo, Ready
from kafila.network.rendezvous_client import MAX_MESSAGE_BYTES, MAX_PENDING_SIGNALS, RendezvousClient

FP = "ab" * 32
BODY = "x" * MAX_SIGNAL_BODY


def member(number: int) -> dict[str, object]:
    return {
        "member_id": f"m{number}", "name": f"machine-{number}", "host": number == 1,
        "capability": {"name": f"machine-{number}", "memory_gib": 8.0},
        "candidates": ["127.0.0.1:4000"], "fingerprint": FP,
    }  # fmt: skip


def flood() -> list[str]:
    """What the hostile rendezvous sends after `opened`, in order; `ended` last, as a marker."""
    sent = [{"type": "member_joined", "member": member(2), "count": 2, "expected_members": 3}]
    sent += [  # a refusal fills most of a message, and concerns nothing asked
        {"type": "error", "code": "invalid_message", "message": "e" * (MAX_MESSAGE_BYTES - 200), "peer": f"m{n}"}
        for n in range(3, 103)
    ]
    sent += [{"type": "signal", "peer": f"m{n}", "body": BODY} for n in range(100, 300) for _ in range(10)]
    sent += [{"type": "signal", "peer": "m2", "body": BODY} for _ in range(3 * MAX_PENDING_SIGNALS)]
    sent += [{"type": "pong", "nonce": nonce} for nonce in range(1, 5000)]
    sent += [{"type": "member_joined", "member": member(n), "count": n, "expected_members": 3} for n in range(3, 203)]
    sent += [{"type": "member_left", "member_id": f"m{n}", "reason": "left"} for n in range(1000, 2000)]
    grant = {"type": "relay_granted", "relay_id": "r", "host": None, "port": 9, "relay_token": "0" * 32}
    sent += [{**grant, "peer": f"m{n}"} for n in range(300, 400)]
    sent.append({"type": "ended", "reason": "expired"})
    return [json.dumps(message) for message in sent]


@asynccontextmanager
async def hostile_rendezvous(messages: list[str]) -> AsyncIterator[str]:
    async def serve(connection: ServerConnection) -> None:
        await connection.recv()  # the open request
        opened = {
            "type": "opened", "code": "7-crimson-harbor", "member_id": "m1", "token": "t" * 32, "model": "m",
            "expected_members": 3, "expires_in_s": 600.0,
        }  # fmt: skip
        await connection.send(json.dumps(opened))
        for message in messages:
            await connection.send(message)
        await connection.wait_closed()

    async with websockets.serve(serve, "127.0.0.1", 0, max_size=None) as server:
        port = next(iter(server.sockets)).getsockname()[1]
        yield f"ws://127.0.0.1:{port}/v1/session"


def test_a_flooding_rendezvous_leaves_the_clients_memory_bounded() -> None:
    async def scenario() -> None:
        messages = flood()
        async with hostile_rendezvous(messages) as url:
            tracemalloc.start()
            try:
                before = tracemalloc.get_traced_memory()[0]
                client = await RendezvousClient.open(
                    url, model="m", expected_members=3, capability=FleetDevice(name="h", memory_gib=8), fingerprint=FP
                )
                await until_async(lambda: client.ended is not None, "the client heard the session end", 60)
                kept = tracemalloc.get_traced_memory()[0] - before
            finally:
                tracemalloc.stop()
            sent = sum(len(m) for m in messages)
            assert sent > 20 << 20  # what a careless client would have kept
            assert kept < 4 << 20, f"the client kept {kept >> 10} KiB of {sent >> 20} MiB sent"
            assert set(client.members) == {f"m{n}" for n in range(2, MAX_MEMBERS + 2)}  # no more than a session holds
            assert list(client._signals) == ["m2"] and len(client._signals["m2"]) == MAX_PENDING_SIGNALS
            assert client.grants == {} and client.departed == {}
            assert client.take_signals("m150") == []  # a non-member's signals were never kept
            await client.close()

    asyncio.run(asyncio.wait_for(scenario(), 120))


def test_a_message_past_the_largest_legitimate_one_ends_the_connection() -> None:
    """Rather than buffer it: the session is lost, the machine is not."""
    largest = Ready(host="m1", members=[MemberInfo.model_validate(member(n)) for n in range(1, MAX_MEMBERS + 1)])
    assert len(largest.model_dump_json()) < MAX_MESSAGE_BYTES // 2

    async def scenario() -> None:
        huge = json.dumps({"type": "error", "code": "invalid_message", "message": "e" * (3 << 20)})
        async with hostile_rendezvous([huge]) as url:
            client = await RendezvousClient.open(
                url, model="m", expected_members=3, capability=FleetDevice(name="h", memory_gib=8), fingerprint=FP
            )
            await asyncio.wait_for(client.wait_closed(), 10)
            assert client.closed

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_a_refusal_is_kept_only_as_long_as_the_wire_allows() -> None:
    refusal = Error.model_validate_json(
        json.dumps({"type": "error", "code": "invalid_message", "message": "e" * 10_000})
    )
    assert len(refusal.message) == MAX_ERROR_MESSAGE
