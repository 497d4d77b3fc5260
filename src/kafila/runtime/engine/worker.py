"""A block stage in its own process: frames in from its ring predecessor, frames out to its successor.

Started by the local pipeline as `python -m kafila.runtime.engine.worker`. It loads its stage, listens,
prints `READY <port>`, reads `NEXT <port>` on stdin, connects to its successor and serves until
its predecessor hangs up. Frames that arrive together are run as one batched decode, but for the
rows of a step sent a frame a row, each passed on as soon as it is decoded (`as_decoded`).
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import socket
import sys
from collections.abc import Sequence

from kafila.contracts import StageReport
from kafila.runtime.engine.sampling import SamplerStart
from kafila.runtime.engine.stage import BlockStage, HeadStage, StepInput, run_isolating
from kafila.runtime.llama.loading import computed_as_served
from kafila.runtime.llama.model import ContextSettings
from kafila.wire.frames import HIDDEN_KINDS, SAMPLE_ON_HEAD, Frame, FrameDecoder, FrameError, Kind

# The sequence id of a worker's last ERROR frame when it gives up its stream (a frame it cannot
# decode poisons everything after it): in the control range, so it names no request, and the
# head takes it for the whole ring failing, not one sequence.
STREAM_ERROR_SEQUENCE = (1 << 64) - 1
MAX_ERROR_TEXT = 4000


RingStage = BlockStage | HeadStage  # what a ring member serves: blocks, or the last blocks and the output


def stage_stats(stage: RingStage) -> StageReport:
    return stage.timer.report((stage.first_block, stage.first_block + stage.n_layers), totals=True)


def refusal(stage: RingStage, frame: Frame, error: Exception) -> Frame:
    """The ERROR frame that answers a frame this stage could not run: on its sequence, with the reason."""
    text = f"{stage.name} refused sequence {frame.sequence_id}: {error}"
    return Frame(Kind.ERROR, frame.sequence_id, payload=text.encode()[:MAX_ERROR_TEXT])


def _run(stage: RingStage, batch: Sequence[Frame]) -> list[Frame]:
    """Hidden-state frames through the stage as one batched decode: hidden states out of a block
    stage, a LOGITS row (after each frame's last row) out of a head, or for a VERIFY frame (a token
    and its drafts) the ROWS of each row's largest logits; where the request asks for log
    probabilities, each answer carries its rows' log-sum-exp and largest entries too
    (`Frame.with_logprobs`). A VERIFY frame marked row by row (a
    greedy request's) goes one row a decode here too, as it does at every stage
    (`stage._decodes`). A token and its drafts are timed as the decodes they ran as, as a head on
    the host times them: drafts in flight are priced by the decodes' sizes (planner.waves), and a
    prompt's chunks by the rest."""
    steps = [StepInput(f.sequence_id, f.position, f.hidden_states()) for f in batch]
    decode = all(f.kind in (Kind.DECODE, Kind.VERIFY) for f in batch)
    row_by_row = [f.row_by_row for f in batch]
    if isinstance(stage, HeadStage):
        every_row = [f.kind is Kind.VERIFY for f in batch]
        logits = []
        for frame, row in zip(batch, stage.forward(steps, decode, None, every_row, row_by_row), strict=True):
            assert row is not None  # every step's last row is asked for
            if frame.kind is Kind.VERIFY:  # handle_frames has checked its top
                answer = Frame.of_rows(frame.sequence_id, frame.position, row, frame.top)
            elif frame.top == SAMPLE_ON_HEAD:  # handle_frames has checked that the sequence has a sampler
                token = stage.sample(frame.sequence_id, row)
                answer = Frame.of_choice(frame.sequence_id, frame.position, token, row[token], row.shape[0])
            else:
                answer = Frame.of_logits(frame.sequence_id, frame.position, row, frame.top)
            # The host sees at most part of each row: it needs the whole row's log-sum-exp to normalise.
            logits.append(answer.with_logprobs(row, frame.logprobs) if frame.logprobs >= 0 else answer)
        return logits
    return [
        Frame.of_hidden(
            frame.kind,
            frame.sequence_id,
            frame.position,
            states,
            frame.dtype,
            frame.top,
            frame.logprobs,
            frame.row_by_row,
        )
        for frame, states in zip(batch, stage.forward(steps, decode, row_by_row), strict=True)
    ]


def handle_frames(stage: RingStage, frames: Sequence[Frame]) -> list[Frame]:
    """Run a burst of frames through the stage, batching consecutive hidden-state frames.

    Every hidden-state frame gets exactly one frame back: its output, or an ERROR frame on its
    sequence when this stage cannot run it (out of position order, the wrong width, llama.cpp
    refusing it). When a batch fails, its frames are run again one at a time (the failed forward
    has taken its rows out of the cache), so one sequence's fault fails only that sequence. An
    ERROR frame from upstream is passed on unchanged, so that it reaches the host.
    """
    out: list[Frame] = []
    batch: list[Frame] = []

    def flush() -> None:
        if batch:
            out.extend(run_isolating(batch, lambda b: _run(stage, b), lambda f, e: refusal(stage, f, e), _sequence))
            batch.clear()

    for frame in frames:
        if frame.kind in HIDDEN_KINDS:
            error = _unrunnable(stage, frame)
            if error is not None:  # refused alone: it would only fail the batch it joined
                flush()
                out.append(refusal(stage, frame, error))
            else:
                batch.append(frame)
            continue
        flush()
        if frame.kind is Kind.SAMPLER and isinstance(stage, HeadStage):
            try:
                stage.start_sampling(frame.sequence_id, SamplerStart.from_payload(frame.payload))
            except ValueError as error:  # no answer: the sequence's rows are refused, with this reason
                stage.refuse_sampling(frame.sequence_id, str(error))
        elif frame.kind is Kind.CANCEL:
            stage.forget(frame.sequence_id, frame.position)  # a cut after a prefix the next request reuses
            out.append(frame)
        elif frame.kind is Kind.PING and frame.payload:
            report = json.loads(frame.payload)
            report.setdefault("stages", []).append(stage_stats(stage).wire())
            out.append(Frame(Kind.PING, frame.sequence_id, payload=json.dumps(report).encode()))
        else:
            out.append(frame)
    flush()
    return out


def as_decoded(frames: Sequence[Frame]) -> list[list[Frame]]:
    """A burst of frames in the pieces a stage runs and answers one after another, so that the next
    stage decodes a row while this one decodes the row behind it. Frames of one row of a step
    decoded one row a decode (`Frame.row_by_row`, sent a frame a row: `engines.rows_as_decoded`)
    go in rounds, as a stage's decodes group a step's rows (`stage._row_rounds`): round i holds
    each sequence's i-th such frame, round 0 the burst's other hidden-state frames too. A frame
    that does not go in a round, or would pass one of its sequence's frames there, closes the
    rounds open and comes after them: one that is not hidden states (a CANCEL, a PING, a sampler's
    start, an ERROR passed on), a row-by-row frame of a sequence with other hidden states open,
    or other hidden states of a sequence with row-by-row frames open. So each sequence's frames
    keep their order, as the host's count of answers needs."""
    pieces: list[list[Frame]] = []
    rounds: list[list[Frame]] = []
    rows: dict[int, int] = {}  # sequence → its row-by-row frames in the open rounds
    others: set[int] = set()  # sequences with other hidden-state frames in the open rounds

    def close() -> None:
        pieces.extend(rounds)
        rounds.clear()
        rows.clear()
        others.clear()

    for frame in frames:
        sequence = frame.sequence_id
        if frame.kind not in HIDDEN_KINDS:
            close()
            pieces.append([frame])
            continue
        if sequence in (others if frame.row_by_row else rows):
            close()
        index = rows.get(sequence, 0) if frame.row_by_row else 0
        if frame.row_by_row:
            rows[sequence] = index + 1
        else:
            others.add(sequence)
        if index == len(rounds):
            rounds.append([])
        rounds[index].append(frame)
    close()
    return pieces


def _unrunnable(stage: RingStage, frame: Frame) -> Exception | None:
    """Why this stage cannot run a hidden-state frame at all, found before it joins a batch."""
    if frame.hidden != stage.hidden:
        return FrameError(f"frame of hidden size {frame.hidden}; this stage takes {stage.hidden}")
    if frame.top == SAMPLE_ON_HEAD and isinstance(stage, HeadStage) and not stage.samples(frame.sequence_id):
        return ValueError(stage.why_not_sampling(frame.sequence_id))
    if frame.kind is Kind.VERIFY and isinstance(stage, HeadStage) and not 0 < frame.top < SAMPLE_ON_HEAD:
        return ValueError(f"a VERIFY frame asks for each row's top 1 to {SAMPLE_ON_HEAD - 1} logits, not {frame.top}")
    return None


def _sequence(frame: Frame) -> int:
    return frame.sequence_id


def serve(stage: RingStage, upstream: socket.socket, downstream: socket.socket) -> None:
    decoder = FrameDecoder()
    buffer = bytearray(1 << 20)  # reused: a fresh megabyte per recv costs more than the frame
    view = memoryview(buffer)
    while received := upstream.recv_into(buffer):
        try:
            for piece in as_decoded(decoder.feed(view[:received])):  # a row's answer goes before the next runs
                if frames := handle_frames(stage, piece):
                    downstream.sendall(b"".join(frame.encode() for frame in frames))
        except (FrameError, ValueError, RuntimeError) as error:  # a stream this stage can no longer follow
            text = f"{stage.name} gave up its stream: {error}".encode()[:MAX_ERROR_TEXT]
            downstream.sendall(Frame(Kind.ERROR, STREAM_ERROR_SEQUENCE, payload=text).encode())
            return


def main(argv: Sequence[str] | None = None) -> None:
    faulthandler.enable()  # a native crash leaves the Python stack in the log the host reads
    parser = argparse.ArgumentParser(prog="python -m kafila.runtime.engine.worker")
    parser.add_argument("--model", required=True)
    parser.add_argument("--n-ctx", type=int, default=4096)
    parser.add_argument("--n-batch", type=int, default=512)
    parser.add_argument("--n-seq", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--head", action="store_true", help="the file is the head's: answer with logits")
    args = parser.parse_args(argv)
    settings = ContextSettings(n_ctx=args.n_ctx, n_batch=args.n_batch, n_seq_max=args.n_seq, n_threads=args.threads)
    stage: RingStage = HeadStage(args.model, settings) if args.head else BlockStage(args.model, settings)
    listener = socket.create_server(("127.0.0.1", 0))
    print(f"READY {listener.getsockname()[1]}", flush=True)
    command = sys.stdin.readline().split()
    if len(command) != 2 or command[0] != "NEXT":
        raise SystemExit(f"expected 'NEXT <port>' on stdin, got {command!r}")
    downstream = socket.create_connection(("127.0.0.1", int(command[1])))
    upstream, _ = listener.accept()
    listener.close()
    for connection in (upstream, downstream):
        connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        computed_as_served(lambda: serve(stage, upstream, downstream))  # as a member computes
    finally:
        downstream.close()
        upstream.close()
        stage.close()


if __name__ == "__main__":
    main()
