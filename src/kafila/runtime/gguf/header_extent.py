"""Where a GGUF file's header ends, found from its first bytes as they arrive.

A model on the hub is planned from its header, read by range (`kafila.hub.ranges`). How long the
header is shows only at its end (the tensor table follows the metadata, whose vocabulary alone is
megabytes), so the read asks for more than the header may need; `HeaderExtent` walks the bytes as
they come and says where the header ends, so that the read stops there rather than running on into
the weights. It only measures: the header is then read and checked as a whole (`HeaderReader`).
"""

from __future__ import annotations

import struct
from collections.abc import Generator

_MAGIC = b"GGUF"
_STRING, _ARRAY = 8, 9  # GGUF value types with a length of their own
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # by GGUF value type
_INTEGER = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 10: "<Q", 11: "<q"}
_ALIGNMENT_KEY = b"general.alignment"
DEFAULT_ALIGNMENT = 32  # GGUF's, where the file names none


class HeaderExtent:
    """A GGUF file's first bytes, taken as they arrive (`feed`), and where its header ends: `length`
    once the bytes reach the end of its tensor table (the padding after it included, as
    `HeaderReader.header_bytes` counts it). `unknown` where the bytes are no header this walks (not
    little-endian GGUF, an unknown value type, nested arrays): the caller then reads as it would
    without it."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.length: int | None = None
        self.unknown = False
        self._walk = self._walked()
        self._wanted = next(self._walk)

    @property
    def complete(self) -> bool:
        """Whether the bytes so far hold the whole header."""
        return self.length is not None and len(self.data) >= self.length

    def feed(self, chunk: bytes) -> bool:
        """Take the next bytes of the file; whether the header is now complete."""
        self.data += chunk
        while self.length is None and not self.unknown and len(self.data) >= self._wanted:
            try:
                self._wanted = self._walk.send(None)
            except StopIteration as ended:
                self.length = ended.value
                self.unknown = ended.value is None
        return self.complete

    def _walked(self) -> Generator[int, None, int | None]:
        """Walks the header, yielding how many bytes it needs before it goes on; returns its length
        (None: not a header this walks)."""
        data = self.data
        yield 24
        if data[:4] != _MAGIC:
            return None
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", data, 4)
        if version & 0xFFFF == 0:  # a big-endian file
            return None
        at, alignment = 24, DEFAULT_ALIGNMENT
        for _ in range(n_kv):
            yield at + 8
            key = slice(at + 8, at + 8 + int.from_bytes(data[at : at + 8], "little"))
            at = key.stop
            yield at + 4
            kind = int.from_bytes(data[at : at + 4], "little")
            at += 4
            if kind == _ARRAY:
                yield at + 12
                kind, count = struct.unpack_from("<IQ", data, at)
                at += 12
                if kind == _STRING:
                    for _ in range(count):
                        if at + 8 > len(data):
                            yield at + 8
                        at += 8 + int.from_bytes(data[at : at + 8], "little")
                elif kind in _SCALAR_BYTES:
                    at += count * _SCALAR_BYTES[kind]
                else:
                    return None
            elif kind == _STRING:
                yield at + 8
                at += 8 + int.from_bytes(data[at : at + 8], "little")
            elif kind in _SCALAR_BYTES:
                yield at + _SCALAR_BYTES[kind]
                if kind in _INTEGER and data[key] == _ALIGNMENT_KEY:
                    alignment = struct.unpack_from(_INTEGER[kind], data, at)[0]
                at += _SCALAR_BYTES[kind]
            else:
                return None
        for _ in range(n_tensors):
            yield at + 8
            at += 8 + int.from_bytes(data[at : at + 8], "little")
            yield at + 4
            at += 4 + 8 * int.from_bytes(data[at : at + 4], "little") + 4 + 8
        if alignment <= 0:
            return None
        return -(-at // alignment) * alignment
