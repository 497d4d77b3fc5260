"""`kafila join`: one member's side of a session.

After the trust exchange and its links are up, a member does only what the host's control
messages say: obtain a stage file (already cached, sliced from its own copy of the model, or
received over the link), load it, and run it between its ring neighbours until the host
reassigns or ends the session. The stage runs in a worker thread, so the links' event loop keeps
answering keep-alives while llama.cpp computes.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from kafila.network.frames import Frame, Kind
from kafila.network.link import LinkError
from kafila.runtime.llama_backend import ContextSettings
from kafila.runtime.slicer import file_sha256
from kafila.runtime.stage import BlockStage
from kafila.runtime.worker import handle_frames
from kafila.session.protocol import Assign, End, Failed, Hello, Loaded
from kafila.session.router import Channel, LinkRouter

Say = Callable[[str], None]


class SessionEnded(Exception):
    """The host ended the session (cleanly, with a reason) or vanished."""


def cached_stage_hashes(cache: Path, limit: int = 1024) -> list[str]:
    """Stage files already here, by the hash they are named after (the slicer's naming)."""
    if not cache.is_dir():
        return []
    names = sorted(p.stem for p in cache.glob("*.gguf") if len(p.stem) == 64)
    return [n for n in names if all(c in "0123456789abcdef" for c in n)][:limit]


async def serve_stage(stage: BlockStage, inbound: Channel, outbound: Channel, executor: ThreadPoolExecutor) -> None:
    """Frames from the predecessor through the stage to the successor, batching what arrives together.

    A frame the stage rejects (wrong hidden size, bad shape) becomes an ERROR frame sent on
    round the ring, so the host fails that request with the reason and this member carries on.
    """
    loop = asyncio.get_running_loop()
    while True:
        frames = [await inbound.receive()]
        while (more := inbound.receive_nowait()) is not None:
            frames.append(more)
        try:
            out = await loop.run_in_executor(executor, handle_frames, stage, frames)
        except Exception as error:
            sequence = next((f.sequence_id for f in frames if f.kind in (Kind.PREFILL, Kind.DECODE)), 0)
            out = [Frame(Kind.ERROR, sequence, payload=f"stage {stage.first_block}: {error}".encode()[:4000])]
        for frame in out:
            await outbound.send(frame)


@dataclass
class MemberState:
    cache: Path
    model: Path | None
    threads: int
    say: Say
    stage: BlockStage | None = None
    serving: asyncio.Task[None] | None = None
    executor: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="stage"))

    async def drop_stage(self) -> None:
        if self.serving is not None:
            self.serving.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self.serving
            self.serving = None
        if self.stage is not None:
            stage, self.stage = self.stage, None
            await asyncio.get_running_loop().run_in_executor(self.executor, stage.close)


async def obtain_stage_file(assign: Assign, host: LinkRouter, state: MemberState) -> Path:
    """The assigned stage file in the cache, verified by its hash, by whichever way the host said."""
    path = state.cache / f"{assign.sha256}.gguf"
    if assign.source == "slice":
        if state.model is None:
            raise ValueError("the host asked for a local slice, but this member has no --model")
        from kafila.runtime.slicer import block_range_file

        state.say(f"slicing blocks {assign.first_block}-{assign.end_block - 1} from {state.model.name}")
        made = await asyncio.to_thread(block_range_file, state.model, assign.first_block, assign.end_block, state.cache)
        path = Path(made.path)
    elif assign.source == "transfer":
        from kafila.network.transfer import receive_stage_file

        state.say(f"receiving stage {assign.stage_index} ({assign.size / 1e6:.1f} MB) from the host")
        path = Path(await receive_stage_file(host.transfer, state.cache))
    if not path.is_file():
        raise ValueError(f"stage file {assign.sha256[:12]}… is not in the cache at {state.cache}")
    digest = await asyncio.to_thread(file_sha256, path)
    if digest != assign.sha256:
        raise ValueError(f"stage file {path.name} has sha256 {digest[:12]}…, not the assigned {assign.sha256[:12]}…")
    return path


async def follow_host(
    host: LinkRouter, routers: dict[str, LinkRouter], state: MemberState, model_sha: str | None
) -> str:
    """Carry out the host's control messages until it ends the session; returns its reason."""
    await host.send_control(Hello(model_sha256=model_sha, cached_stages=cached_stage_hashes(state.cache)))
    try:
        while True:
            try:
                message = await host.next_control()
            except LinkError as error:
                raise SessionEnded(f"lost the host: {error}") from None
            if isinstance(message, End):
                return message.reason
            if not isinstance(message, Assign):
                continue
            await state.drop_stage()
            for router in routers.values():
                router.activation.drain()  # frames of a broken ring must not reach the new one
            started = time.perf_counter()
            try:
                missing = [p for p in (message.predecessor, message.successor) if p not in routers]
                if missing:
                    raise ValueError(f"no link to {', '.join(missing)}")
                path = await obtain_stage_file(message, host, state)
                settings = ContextSettings(
                    n_ctx=message.n_ctx, n_batch=message.n_batch, n_seq_max=message.n_seq_max, n_threads=state.threads
                )
                loop = asyncio.get_running_loop()
                state.stage = await loop.run_in_executor(state.executor, BlockStage, path, settings)
            except Exception as error:
                state.say(f"cannot load stage {message.stage_index}: {error}")
                await host.send_control(Failed(epoch=message.epoch, message=str(error)))
                continue
            inbound = routers[message.predecessor].activation
            outbound = routers[message.successor].activation
            state.serving = asyncio.create_task(serve_stage(state.stage, inbound, outbound, state.executor))
            seconds = time.perf_counter() - started
            state.say(f"serving blocks {message.first_block}-{message.end_block - 1} (ready in {seconds:.1f} s)")
            await host.send_control(Loaded(epoch=message.epoch, stage_index=message.stage_index, seconds=seconds))
    finally:
        await state.drop_stage()
        state.executor.shutdown(wait=False)
