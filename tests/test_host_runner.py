"""The host's shell hands its session core what the command line asked for, checked on the real
`HostRunner` with a tiny model file, without starting anything."""

from __future__ import annotations

import socket
from pathlib import Path

from tiny_models import write_tiny_model

from kafila.planner.types import ServingSpec
from kafila.session.availability import Availability
from kafila.session.core import Phase, SessionCore
from kafila.session.runner import HostConfig, HostRunner


def test_the_host_hands_its_core_the_rebalance_setting_and_one_machine_never_rebalances(tmp_path: Path) -> None:
    """`kafila host --no-rebalance` reaches the rule that judges rebalances; a host of one machine
    has nothing to divide again. (What the rule then does: tests/test_session_core.py.)"""
    model = write_tiny_model(tmp_path / "tiny.gguf", "llama", n_blocks=2)

    def core_of(members: int, rebalance: bool) -> SessionCore:
        config = HostConfig(
            path=model, counts=[2], session=ServingSpec(context=256, concurrency=1), sock=socket.socket(),
            api_key=None, threads=1, members=members, rendezvous=None, rendezvous_bind="127.0.0.1",
            rendezvous_port=0, stun_port=0, demo=False, name="host", rebalance=rebalance,
        )  # fmt: skip
        config.sock.close()
        return HostRunner(config, Availability(), ui=None).core  # type: ignore[arg-type]

    assert core_of(3, rebalance=True).serving.rebalance and core_of(3, rebalance=True).networked
    assert not core_of(3, rebalance=False).serving.rebalance
    alone = core_of(1, rebalance=True)
    assert not alone.serving.rebalance and not alone.networked and alone.phase == Phase.DEPLOYING
