"""The activation frame: a fixed binary header and a payload, encoded and decoded without I/O.

One codec serves every transport (local sockets now, QUIC streams later), so a stage never
knows how its frames travelled. The layout is documented in docs/protocol.md.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, replace
from enum import IntEnum

import numpy as np
import numpy.typing as npt

MAGIC = b"KF"
VERSION = 1
HEADER = struct.Struct("<2sBBBBHQIIII")  # magic, version, kind, dtype, flags, top, seq, pos, n, hidden, len
HEADER_SIZE = HEADER.size  # 32 bytes
MAX_TOKENS = 1 << 16
MAX_HIDDEN = 1 << 16
MAX_VOCAB = 1 << 21  # a LOGITS row: the largest vocabularies in use hold some 262,000 entries
MAX_TOP = (1 << 16) - 1  # the header's `top` field
# The `top` value that asks a head on a member to sample the row itself, with the sampler a
# SAMPLER frame started for the sequence, and answer with the chosen token alone (a top-1 LOGITS
# frame). `SamplingSettings.top_logits` never asks for this many.
SAMPLE_ON_HEAD = MAX_TOP
# A frame's `flags` byte, on PREFILL/DECODE/VERIFY frames and the LOGITS or ROWS frame that
# answers them: 0, or LOGPROBS_FLAG | k for a request that asks for log probabilities with k
# alternatives per token. The head then appends to its payload each row's log-sum-exp (f32) and
# k largest entries (k int32 ids, then k f32 logits; `_logprob_trailer`), so the host can
# normalise what it samples from. A peer from before ROWS frames carried it refuses the flag there.
LOGPROBS_FLAG = 0x80
MAX_TOP_LOGPROBS = 20  # OpenAI's limit on chat's top_logprobs; completions allow 5
# On VERIFY frames only, beside those bits: every stage decodes the frame's rows one row a
# decode, as a greedy request's rows go without drafts, so that its text is exactly theirs
# (llama.cpp's product of several columns rounds otherwise than its product of one). A peer from
# before it refuses the bit as an unknown flag (FrameError).
ROW_BY_ROW_FLAG = 0x40
NO_LOGPROBS = -1
MAX_SAMPLER_START_BYTES = 1 << 23  # a SAMPLER frame's JSON: the settings and a prompt of ~10^6 token ids
MAX_PAYLOAD = 1 << 28  # 256 MiB: a 4096-token prefill chunk of a hidden-16384 model in f32
# Sequence ids from 2**63 up are reserved for control streams, never request slots, so their
# streams cannot collide with a request's: stage-file transfers (`kafila.network.transfer`) use
# TRANSFER_SEQUENCE_IDS, the session's control stream 2**64 - 1 (`kafila.wire.control`).
# FILE frames are refused outside this range.
CONTROL_SEQUENCE_BASE = 1 << 63
TRANSFER_SEQUENCE_IDS = range(CONTROL_SEQUENCE_BASE, CONTROL_SEQUENCE_BASE + (1 << 32))  # one drawn for each attempt


class Kind(IntEnum):
    PREFILL = 1  # hidden states of a prompt chunk
    DECODE = 2  # hidden states of one generated token (or a few, one per sequence)
    RESULT = 3  # token ids produced for a sequence
    CANCEL = 4  # drop a sequence's state everywhere on the ring
    PING = 5  # keep-alive or a control message with a JSON payload
    ERROR = 6  # a UTF-8 message: the peer rejected a frame
    FILE = 7  # raw bytes of a file in transfer; `position` is the chunk's index (kafila.network.transfer)
    LOGITS = 8  # a head on a member answers the host: logits after a step's last row, `hidden` = vocabulary
    SAMPLER = 9  # the host starts a sequence's sampler on a head on a member: JSON settings and prompt
    # Hidden states of a generated token and the tokens drafted after it (speculative decoding):
    # the head answers every row, a head on a member with a ROWS frame.
    VERIFY = 10
    ROWS = 11  # a head on a member answers a VERIFY frame: each row's `top` largest logits, `hidden` = vocabulary


class DType(IntEnum):
    NONE = 0  # no tensor: CANCEL, PING, ERROR, FILE, SAMPLER
    F32 = 1
    F16 = 2
    I32 = 3  # token ids; in a LOGITS frame, the top entries: `n_tokens` int32 ids, then as many f32 values


_ITEM_SIZE = {DType.NONE: 1, DType.F32: 4, DType.F16: 2, DType.I32: 4}
_NUMPY = {DType.F32: np.float32, DType.F16: np.float16, DType.I32: np.int32}
HIDDEN_KINDS = (Kind.PREFILL, Kind.DECODE, Kind.VERIFY)


def is_control_sequence(sequence_id: int) -> bool:
    """Whether a sequence id is in the range reserved for control streams (stage-file transfers)."""
    return sequence_id >= CONTROL_SEQUENCE_BASE


class FrameError(ValueError):
    """A frame that breaks the protocol: the stream that carried it cannot be trusted further."""


LARGEST_BLOCK = 512  # `largest` searches a row by blocks of this many values


def largest(row: npt.NDArray[np.floating], top: int) -> npt.NDArray[np.intp]:
    """The ids of a row's `top` largest values (in no order; ties at the edge broken either way,
    as `np.argpartition` breaks them). A head on a member answers each row of a sampled request
    with these: argpartition over a 262,144-token row takes 2.2 ms of its core, which is the
    ring's slowest with four users. The `top` largest all lie in the blocks holding the `top`
    largest block maxima (each value left out has `top` of those maxima at or above it), so only
    those blocks and the row's ragged end are searched: 0.2 ms (docs/benchmarks.md, helper-59)."""
    whole = row.shape[0] // LARGEST_BLOCK
    if whole <= top:
        return np.argpartition(row, -top)[-top:]
    maxima = row[: whole * LARGEST_BLOCK].reshape(whole, LARGEST_BLOCK).max(axis=1)
    blocks = np.argpartition(maxima, -top)[-top:]
    candidates = np.concatenate(
        [
            (blocks[:, None] * LARGEST_BLOCK + np.arange(LARGEST_BLOCK)).ravel(),
            np.arange(whole * LARGEST_BLOCK, row.shape[0]),
        ]
    )
    return candidates[np.argpartition(row[candidates], -top)[-top:]]


@dataclass(frozen=True)
class Frame:
    kind: Kind
    sequence_id: int
    position: int = 0  # position of the first token in its sequence
    n_tokens: int = 0
    hidden: int = 0
    dtype: DType = DType.NONE
    payload: bytes = b""
    # On PREFILL/DECODE frames: how many of the largest logits the host's sampler needs after this
    # step (0: all). Every stage passes it on; a head on a member then sends only those.
    top: int = 0
    # On PREFILL/DECODE and LOGITS frames: how many alternatives per token a request's log
    # probabilities carry (0..MAX_TOP_LOGPROBS), or NO_LOGPROBS; travels in the header's flags.
    logprobs: int = NO_LOGPROBS
    # On VERIFY frames: decode the rows one row a decode at every stage (ROW_BY_ROW_FLAG).
    row_by_row: bool = False

    @property
    def wire_bytes(self) -> int:
        """What the frame takes on the wire, and costs a side that holds it: header and payload."""
        return HEADER_SIZE + len(self.payload)

    def header(self) -> bytes:
        """The 32-byte header alone: a sender can write it and then the payload, uncopied."""
        return HEADER.pack(
            MAGIC,
            VERSION,
            self.kind,
            self.dtype,
            (0 if self.logprobs < 0 else LOGPROBS_FLAG | self.logprobs) | (ROW_BY_ROW_FLAG if self.row_by_row else 0),
            self.top,
            self.sequence_id,
            self.position,
            self.n_tokens,
            self.hidden,
            len(self.payload),
        )

    def encode(self) -> bytes:
        return self.header() + self.payload

    @classmethod
    def of_hidden(
        cls,
        kind: Kind,
        sequence_id: int,
        position: int,
        states: npt.NDArray[np.floating],
        dtype: DType = DType.F32,
        top: int = 0,
        logprobs: int = NO_LOGPROBS,
        row_by_row: bool = False,
    ) -> Frame:
        rows = np.ascontiguousarray(states, dtype=_NUMPY[dtype])
        if rows.ndim != 2:
            raise ValueError("hidden states must be a (tokens, hidden) matrix")
        if row_by_row and kind is not Kind.VERIFY:
            raise ValueError(f"a {kind.name} frame decoded row by row: only VERIFY frames are")
        if not 0 <= top <= MAX_TOP:
            raise ValueError(f"top {top} is outside 0..{MAX_TOP}")
        if not NO_LOGPROBS <= logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"logprobs {logprobs} is outside {NO_LOGPROBS}..{MAX_TOP_LOGPROBS}")
        shape = rows.shape
        return cls(kind, sequence_id, position, shape[0], shape[1], dtype, rows.tobytes(), top, logprobs, row_by_row)

    @classmethod
    def of_logits(cls, sequence_id: int, position: int, logits: npt.NDArray[np.floating], top: int = 0) -> Frame:
        """A row of logits answering the step that started at `position`, in f32, since rounding
        them could change which token a greedy request picks. With `top`, only the `top` largest
        (ids and values): what a sampler that keeps no more than those needs, at a fraction of the
        bytes (a 262k vocabulary's row is 1 MiB). `top` 1 is the lowest index of the largest
        value, as `np.argmax` of the whole row picks."""
        row = np.ascontiguousarray(logits, dtype=np.float32).reshape(-1)
        if not 0 < top < row.shape[0]:
            return cls(Kind.LOGITS, sequence_id, position, 1, row.shape[0], DType.F32, row.tobytes())
        ids = np.array([np.argmax(row)]) if top == 1 else largest(row, top)
        ids = ids.astype(np.int32)
        payload = ids.tobytes() + row[ids].astype(np.float32).tobytes()
        return cls(Kind.LOGITS, sequence_id, position, top, row.shape[0], DType.I32, payload)

    @classmethod
    def of_rows(cls, sequence_id: int, position: int, logits: npt.NDArray[np.floating], top: int) -> Frame:
        """A head's answer to a VERIFY frame: the `top` largest logits after each of its rows (ids,
        then values, row by row), chosen as `of_logits` chooses them for one row."""
        rows = np.ascontiguousarray(logits, dtype=np.float32)
        if rows.ndim != 2 or not 0 < top <= min(rows.shape[1], MAX_TOP):
            raise ValueError(f"top {top} of logits shaped {rows.shape}")
        if top == 1:
            ids = rows.argmax(axis=1)[:, None]
        else:
            ids = np.stack([largest(row, top) for row in rows])
        values = np.take_along_axis(rows, ids, axis=1)
        payload = ids.astype(np.int32).tobytes() + values.astype(np.float32).tobytes()
        return cls(Kind.ROWS, sequence_id, position, rows.shape[0], rows.shape[1], DType.I32, payload, top)

    def rows(self) -> npt.NDArray[np.float32]:
        """A ROWS frame as a (rows, vocabulary) matrix, -inf where it sent nothing. The caller bounds
        the rows first (the host: those of the step it sent); the ids are checked, as a member sent them."""
        if self.kind is not Kind.ROWS:
            raise FrameError(f"a {self.kind.name} frame carries no rows of logits")
        count = self.n_tokens * self.top
        ids = np.frombuffer(self.payload, dtype=np.int32, count=count).reshape(self.n_tokens, self.top)
        values = np.frombuffer(self.payload, dtype=np.float32, count=count, offset=4 * count)
        if ids.size and (ids.min() < 0 or ids.max() >= self.hidden):
            raise FrameError(f"a ROWS frame names a token outside its {self.hidden} entries")
        if np.isnan(values).any():
            raise FrameError("a ROWS frame carries a NaN logit")
        out = np.full((self.n_tokens, self.hidden), -np.inf, dtype=np.float32)
        np.put_along_axis(out, ids.astype(np.intp), values.reshape(self.n_tokens, self.top), axis=1)
        return out

    @classmethod
    def of_choice(cls, sequence_id: int, position: int, token: int, logit: float, vocabulary: int) -> Frame:
        """A head's answer to a row it sampled itself: the chosen token alone, as a top-1 frame."""
        payload = np.array([token], dtype=np.int32).tobytes() + np.array([logit], dtype=np.float32).tobytes()
        return cls(Kind.LOGITS, sequence_id, position, 1, vocabulary, DType.I32, payload)

    def with_logprobs(self, logits: npt.NDArray[np.floating], alternatives: int) -> Frame:
        """This LOGITS (or ROWS) frame with what the host needs to report log probabilities of the
        token it takes from each row: the whole row's log-sum-exp, and its `alternatives` largest
        entries (`logits`: the row, or for ROWS the rows, they were chosen from)."""
        rows = np.asarray(logits, dtype=np.float64)
        rows = rows.reshape(1, -1) if self.kind is Kind.LOGITS else rows
        if self.kind not in (Kind.LOGITS, Kind.ROWS) or rows.shape != (
            self.n_tokens if self.kind is Kind.ROWS else 1,
            self.hidden,
        ):
            raise ValueError(f"log probabilities of logits shaped {rows.shape} for a {self.kind.name} frame")
        if not 0 <= alternatives <= min(MAX_TOP_LOGPROBS, self.hidden):
            raise ValueError(f"{alternatives} log probability alternatives: 0..{MAX_TOP_LOGPROBS}")
        return replace(self, payload=self.payload + _logprob_trailer(rows, alternatives), logprobs=alternatives)

    def logprob_trailer(self) -> tuple[float, npt.NDArray[np.int32], npt.NDArray[np.float32]] | None:
        """A LOGITS frame's log-sum-exp and largest entries (ids, logits), or None where the host
        asked for none; checked, since a member sent them."""
        if self.kind is not Kind.LOGITS or self.logprobs < 0:
            return None
        logsumexps, ids, values = self._logprob_rows(1)
        return float(logsumexps[0]), ids[0], values[0]

    def rows_logprobs(self) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.int32], npt.NDArray[np.float32]] | None:
        """A ROWS frame's log-sum-exp of each row, and each row's largest entries (ids and logits,
        (rows, k) each), or None where the host asked for none; checked, since a member sent them."""
        if self.kind is not Kind.ROWS or self.logprobs < 0:
            return None
        return self._logprob_rows(self.n_tokens)

    def _logprob_rows(
        self, rows: int
    ) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.int32], npt.NDArray[np.float32]]:
        """The trailer `_logprob_trailer` wrote for `rows` rows, checked."""
        k, name = self.logprobs, self.kind.name
        start = len(self.payload) - rows * (4 + 8 * k)
        logsumexps = np.frombuffer(self.payload, dtype=np.float32, count=rows, offset=start)
        ids = np.frombuffer(self.payload, dtype=np.int32, count=rows * k, offset=start + 4 * rows).reshape(rows, k)
        values = np.frombuffer(self.payload, dtype=np.float32, count=rows * k, offset=start + 4 * rows * (1 + k))
        values = values.reshape(rows, k)
        if (
            not np.all(np.isfinite(logsumexps)) or not np.all(np.isfinite(values))
            or np.any(values > logsumexps[:, None] + 1e-3)
        ):  # fmt: skip
            raise FrameError(f"a {name} frame's log probabilities are not finite or exceed their log-sum-exp")
        distinct = all(np.unique(row).size == k for row in ids)
        if ids.size and (ids.min() < 0 or ids.max() >= self.hidden or not distinct):
            raise FrameError(f"a {name} frame's top {k} log probabilities name a token twice or outside its vocabulary")
        return logsumexps, ids, values

    @classmethod
    def of_tokens(cls, sequence_id: int, position: int, tokens: list[int]) -> Frame:
        payload = np.asarray(tokens, dtype=np.int32).tobytes()
        return cls(Kind.RESULT, sequence_id, position, len(tokens), 0, DType.I32, payload)

    def hidden_states(self) -> npt.NDArray[np.float32]:
        """The payload as a float32 (tokens, hidden) matrix."""
        if self.kind not in HIDDEN_KINDS:
            raise FrameError(f"a {self.kind.name} frame carries no hidden states")
        values = np.frombuffer(self.payload, dtype=_NUMPY[self.dtype]).reshape(self.n_tokens, self.hidden)
        return values.astype(np.float32, copy=values.dtype != np.float32)

    def logits(self) -> npt.NDArray[np.float32]:
        """A LOGITS frame's row as a vector over the vocabulary: the entries a top-k frame leaves
        out are -inf, which no sampler that keeps at most k candidates would have picked."""
        if self.kind is not Kind.LOGITS:
            raise FrameError(f"a {self.kind.name} frame carries no logits")
        if self.dtype is DType.F32:
            return np.frombuffer(self.payload, dtype=np.float32, count=self.hidden).copy()
        ids = np.frombuffer(self.payload, dtype=np.int32, count=self.n_tokens)
        if ids.size and (ids.min() < 0 or ids.max() >= self.hidden):
            raise FrameError(f"a top-{self.n_tokens} LOGITS frame names a token outside its {self.hidden} entries")
        row = np.full(self.hidden, -np.inf, dtype=np.float32)
        row[ids] = np.frombuffer(self.payload, dtype=np.float32, count=self.n_tokens, offset=4 * self.n_tokens)
        return row

    def tokens(self) -> list[int]:
        if self.dtype is not DType.I32:
            raise FrameError(f"a {self.kind.name} frame carries no token ids")
        return np.frombuffer(self.payload, dtype=np.int32).tolist()

    def text(self) -> str:
        return self.payload.decode("utf-8", errors="replace")


def top_ids(row: npt.NDArray[np.floating], k: int) -> npt.NDArray[np.intp]:
    """The indices of a row's k largest entries, largest first (ties: lowest index first; where
    the k-th ties an entry left out, the tied ids np.argpartition over the whole row picks). A
    request's log probabilities ask for these every token: where the k-th largest exceeds the next
    (no tie at the edge, no NaN), the k are one set, which `largest` finds searching a few blocks
    (0.17 against 3.5 ms for a 262,144-token row, k = 20); else the whole row is partitioned."""
    if k <= 0:
        return np.zeros(0, dtype=np.intp)
    k = min(k, row.shape[0])
    if k < row.shape[0]:
        near = largest(row, k + 1)  # the k largest and the next: a NaN in the row is among them
        ordered = near[np.lexsort((near, -row[near]))]  # a NaN last
        if row[ordered[k - 1]] > row[ordered[k]]:  # False where either is NaN
            return ordered[:k]
        part = np.argpartition(-row, k - 1)[:k]
    else:
        part = np.arange(row.shape[0])
    return part[np.lexsort((part, -row[part]))]


def _logprob_trailer(rows: npt.NDArray[np.float64], alternatives: int) -> bytes:
    """What a head appends to a LOGITS or ROWS frame for log probabilities: each row's log-sum-exp
    (f32), then each row's `alternatives` largest entries' ids (int32), then their logits (f32)."""
    peaks = rows.max(axis=1)
    logsumexps = peaks + np.log(np.exp(rows - peaks[:, None]).sum(axis=1))
    ids = np.stack([top_ids(row, alternatives) for row in rows]).astype(np.int32)
    values = np.take_along_axis(rows, ids.astype(np.intp), axis=1)
    return logsumexps.astype(np.float32).tobytes() + ids.tobytes() + values.astype(np.float32).tobytes()


def logprobs_of_flags(flags: int) -> int:
    """The alternatives a header's flags ask for, or NO_LOGPROBS; FrameError on any other bits
    (ROW_BY_ROW_FLAG aside: `row_by_row_of_flags`)."""
    flags &= ~ROW_BY_ROW_FLAG
    if flags == 0:
        return NO_LOGPROBS
    if flags & LOGPROBS_FLAG and (flags & ~LOGPROBS_FLAG) <= MAX_TOP_LOGPROBS:
        return flags & ~LOGPROBS_FLAG
    raise FrameError(
        f"frame flags {flags:#04x}: only log probabilities with at most {MAX_TOP_LOGPROBS} alternatives, "
        f"and {ROW_BY_ROW_FLAG:#04x} on a VERIFY frame"
    )


def row_by_row_of_flags(kind: Kind, flags: int) -> bool:
    """Whether a header's flags ask every stage to decode the rows one row a decode; FrameError
    where a frame of any kind but VERIFY does."""
    row_by_row = bool(flags & ROW_BY_ROW_FLAG)
    if row_by_row and kind is not Kind.VERIFY:
        raise FrameError(
            f"a {kind.name} frame with flag {ROW_BY_ROW_FLAG:#04x} (row by row): only VERIFY frames carry it"
        )
    return row_by_row


def _validate(
    kind: int, dtype: int, seq: int, n_tokens: int, hidden: int, length: int, top: int, logprobs: int = NO_LOGPROBS
) -> tuple[Kind, DType]:
    try:
        kind_, dtype_ = Kind(kind), DType(dtype)
    except ValueError as error:
        raise FrameError(str(error)) from None
    if logprobs >= 0:
        if kind_ not in (*HIDDEN_KINDS, Kind.LOGITS, Kind.ROWS):
            raise FrameError(
                f"a {kind_.name} frame asking for log probabilities: only hidden, logits and rows frames do"
            )
        if kind_ in (Kind.LOGITS, Kind.ROWS):
            if logprobs > hidden:
                raise FrameError(f"{logprobs} log probability alternatives of a {hidden}-entry vocabulary")
            length -= (1 if kind_ is Kind.LOGITS else n_tokens) * (4 + 8 * logprobs)  # log-sum-exp, ids, logits
            if length < 0:
                raise FrameError(f"a {kind_.name} frame too short for its {logprobs} log probability alternatives")
    if length > MAX_PAYLOAD:
        raise FrameError(f"payload of {length} bytes exceeds the {MAX_PAYLOAD}-byte limit")
    width_limit = MAX_VOCAB if kind_ in (Kind.LOGITS, Kind.ROWS) else MAX_HIDDEN
    if n_tokens > MAX_TOKENS or hidden > width_limit:
        raise FrameError(f"frame of {n_tokens} tokens x {hidden} exceeds the limits")
    if top and kind_ not in (*HIDDEN_KINDS, Kind.ROWS):
        raise FrameError(f"a {kind_.name} frame with top {top}: only prefill and decode frames (and rows) carry one")
    if kind_ is Kind.LOGITS:
        if hidden == 0:
            raise FrameError("a LOGITS frame over an empty vocabulary")
        if dtype_ is DType.F32:
            if n_tokens != 1:
                raise FrameError("a LOGITS frame carries one f32 row, or the top entries as i32 ids and values")
            if length != 4 * hidden:
                raise FrameError(f"payload of {length} bytes does not hold {hidden} f32 logits")
        elif dtype_ is DType.I32:
            if not 0 < n_tokens <= hidden or length != 8 * n_tokens:
                raise FrameError(f"payload of {length} bytes does not hold the top {n_tokens} of {hidden} logits")
        else:
            raise FrameError("a LOGITS frame carries one f32 row, or the top entries as i32 ids and values")
    elif kind_ is Kind.ROWS:
        if dtype_ is not DType.I32 or n_tokens == 0 or not 0 < top <= hidden or length != 8 * n_tokens * top:
            raise FrameError(f"a ROWS frame holds the top {top} of {hidden} logits (i32 ids, f32 values) of each row")
    elif kind_ in HIDDEN_KINDS:
        if dtype_ not in (DType.F32, DType.F16) or n_tokens == 0 or hidden == 0:
            raise FrameError(f"a {kind_.name} frame needs f32 or f16 hidden states of at least one token")
        if length != n_tokens * hidden * _ITEM_SIZE[dtype_]:
            raise FrameError(f"payload of {length} bytes does not hold {n_tokens} x {hidden} {dtype_.name} values")
    elif kind_ is Kind.SAMPLER:
        if dtype_ is not DType.NONE or n_tokens or hidden:
            raise FrameError("a SAMPLER frame carries JSON: dtype none, no tokens, hidden size 0")
        if length > MAX_SAMPLER_START_BYTES:
            raise FrameError(f"a SAMPLER frame of {length} bytes exceeds the {MAX_SAMPLER_START_BYTES}-byte limit")
    elif kind_ is Kind.FILE:
        if dtype_ is not DType.NONE or n_tokens or hidden:
            raise FrameError("a FILE frame carries raw bytes: dtype none, no tokens, hidden size 0")
        if not is_control_sequence(seq):
            raise FrameError(f"a FILE frame on sequence {seq}, outside the control range (2**63 and up)")
    elif dtype_ is DType.I32 and length != 4 * n_tokens:
        raise FrameError(f"payload of {length} bytes does not hold {n_tokens} token ids")
    return kind_, dtype_


class FrameDecoder:
    """Turns a byte stream into frames; a protocol violation raises FrameError and poisons it.

    A frame's header is checked once, as soon as it is whole; the payload then accumulates
    without being looked at again until it is complete (a 256 KiB frame arrives in some 200
    pieces), and is copied out of the buffer once.
    """

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._broken: FrameError | None = None
        # Of the frame in progress: kind, dtype, sequence, position, rows, hidden, length, top, logprobs, row by row.
        self._header: tuple[Kind, DType, int, int, int, int, int, int, int, bool] | None = None
        self._need = HEADER_SIZE  # bytes the buffer must hold before there is anything to decode

    def feed(self, data: bytes | bytearray | memoryview) -> list[Frame]:
        if self._broken is not None:
            raise self._broken
        self._buffer += data
        frames: list[Frame] = []
        try:
            while len(self._buffer) >= self._need:
                if self._header is None:
                    header = HEADER.unpack_from(self._buffer)
                    magic, version, kind, dtype, flags, top, seq, pos, n, hidden, length = header
                    if magic != MAGIC:
                        raise FrameError("not a Kafila frame (bad magic)")
                    if version != VERSION:
                        raise FrameError(f"frame version {version}; this peer speaks version {VERSION}")
                    logprobs = logprobs_of_flags(flags)
                    kind_, dtype_ = _validate(kind, dtype, seq, n, hidden, length, top, logprobs)
                    row_by_row = row_by_row_of_flags(kind_, flags)
                    self._header = (kind_, dtype_, seq, pos, n, hidden, length, top, logprobs, row_by_row)
                    self._need = HEADER_SIZE + length
                    continue
                kind_, dtype_, seq, pos, n, hidden, length, top, logprobs, row_by_row = self._header
                with memoryview(self._buffer) as view:
                    payload = bytes(view[HEADER_SIZE : self._need])
                del self._buffer[: self._need]
                self._header, self._need = None, HEADER_SIZE
                frames.append(Frame(kind_, seq, pos, n, hidden, dtype_, payload, top, logprobs, row_by_row))
        except FrameError as error:
            self._broken = error
            raise
        return frames

    @property
    def pending_bytes(self) -> int:
        return len(self._buffer)
