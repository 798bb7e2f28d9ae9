"""An Arrow IPC stream file cut into its messages, read one message at a time and bounded.

Why not hand the file to ``pyarrow.ipc``: a history file is written by the training job (or
anyone who can write the run dir), and pyarrow would take it whole and trust every length in
it. Here the reader sees each message's size before reading it, so a file is read in chunks of
at most one message, never past :data:`MAX_HISTORY_BYTES`; it sees each record batch's decoded
size (the lengths its compressed buffers declare) before pyarrow decompresses anything, so a
small file cannot inflate past :data:`MAX_HISTORY_DECODED_BYTES`; and a run of end-of-stream
markers (or zero bytes, the legacy marker) is skipped in one pass over the bytes, not one
reader turn per marker.

Framing (Arrow columnar format, "Encapsulated message format"): ``0xFFFFFFFF``, an int32
metadata length, a ``Message`` flatbuffer, then ``bodyLength`` bytes of body; a zero length is
an end-of-stream marker (older writers: the length without the ``0xFFFFFFFF``).
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO

MAX_HISTORY_BYTES = 512 << 20
"""Bytes a reader takes from one history file; what lies beyond is damage, the rows before it
are used. ddpmon's own take 14 MB per 100,000 steps at 32 groups, and rows grow with the
logarithm of the step count: 10^8 steps at the 256-group maximum stay under ~400 MB."""
MAX_HISTORY_DECODED_BYTES = 512 << 20
"""Bytes one history file's record batches may take once decoded (decompressed): the same
10^8 steps at 256 groups decode to ~450 MB."""
MAX_METADATA_BYTES = 4 << 20
"""One message's flatbuffer (a schema with 256 group names is a few KB)."""

SCHEMA, RECORD_BATCH = 1, 3
"""``MessageHeader`` union tags."""
_CONTINUATION = b"\xff\xff\xff\xff"
_CHUNK = 4 << 20


class Torn(ValueError):
    """A message that cannot be framed: cut off by the end of the file, or corrupt."""


@dataclass(slots=True)
class Frame:
    """One message: its bytes as ``pyarrow.ipc.read_message`` takes them, and what it holds."""

    header: int
    """:data:`SCHEMA`, :data:`RECORD_BATCH` or another ``MessageHeader`` tag."""
    data: bytearray
    end: int
    """Offset just after it."""
    decoded: int
    """Bytes its buffers take once decoded (the body's size when it is not compressed)."""


class Frames:
    """The messages of one open file, in order. Iterating raises :class:`Torn` at a message
    that cannot be framed; it stops early, setting ``over_cap``, where the next message (or
    marker run) would pass ``max_bytes``."""

    def __init__(self, fh: IO[bytes], size: int, max_bytes: int = MAX_HISTORY_BYTES) -> None:
        self.fh, self.size, self.max_bytes = fh, size, max_bytes
        self.over_cap = False
        self.markers_end = 0
        """Offset after the last run of end-of-stream markers read."""

    def __iter__(self) -> Iterator[Frame]:
        pos = 0
        while pos < self.size:
            head = self._read(pos, 8)
            prefix = 8 if head[:4] == _CONTINUATION else 4
            if len(head) < prefix:
                raise Torn(f"{len(head)} stray bytes at offset {pos}")
            length = int.from_bytes(head[prefix - 4:prefix], "little", signed=True)
            if length == 0:
                pos = self.markers_end = self._skip_markers(pos)
                if self.over_cap:
                    return
                continue
            if not 0 < length <= MAX_METADATA_BYTES:
                raise Torn(f"message metadata of {length} bytes at offset {pos}")
            meta = self._read(pos + prefix, length)
            if len(meta) < length:
                raise Torn(f"message at offset {pos} cut off in its metadata")
            header, header_at, body_length = _message(meta)
            end = pos + prefix + length + body_length
            if end > self.size:
                raise Torn(f"message at offset {pos} cut off in its body")
            if end > self.max_bytes:
                self.over_cap = True
                return
            data = bytearray(prefix + length + body_length)
            data[: prefix + length] = head[:prefix] + meta
            self.fh.seek(pos + prefix + length)
            if self.fh.readinto(memoryview(data)[prefix + length:]) != body_length:
                raise Torn(f"message at offset {pos} cut off in its body")
            decoded = body_length
            if header == RECORD_BATCH:
                decoded = _decoded_size(meta, header_at, memoryview(data)[prefix + length:])
            yield Frame(header, data, end, decoded)
            pos = end

    def _read(self, pos: int, n: int) -> bytes:
        self.fh.seek(pos)
        return self.fh.read(n)

    def _skip_markers(self, pos: int) -> int:
        """The offset after the run of end-of-stream markers at ``pos``, read in chunks."""
        while True:
            if pos >= self.max_bytes:
                self.over_cap = pos < self.size
                return pos
            chunk = self._read(pos, min(_CHUNK, self.max_bytes - pos))
            run = marker_run(chunk)
            pos += run
            if run == 0 or len(chunk) < _CHUNK or run < len(chunk) - 8:
                return pos


def marker_run(chunk: bytes) -> int:
    """How many leading bytes of ``chunk`` are end-of-stream markers (``0xFFFFFFFF 0`` or a
    zero word): one vectorised pass over its 32-bit words."""
    import numpy as np  # pyarrow only where a history is read or written: a light CLI start

    words = np.frombuffer(chunk, dtype="<u4", count=len(chunk) // 4)
    zero = words == 0
    marker = (words == 0xFFFFFFFF) & np.append(zero[1:], False)  # followed by its zero length
    bad = ~(zero | marker)
    return 4 * (int(bad.argmax()) if bad.any() else len(words))


def _message(meta: bytes) -> tuple[int, int, int]:
    """``(header tag, offset of the header table, bodyLength)`` of a ``Message`` flatbuffer."""
    try:
        root = _u32(meta, 0)
        header = _field(meta, root, 1)
        tag = meta[header] if header is not None else 0
        at = _field(meta, root, 2)
        body = _field(meta, root, 3)
        body_length = struct.unpack_from("<q", meta, body)[0] if body is not None else 0
        header_at = at + _u32(meta, at) if at is not None else -1
    except (struct.error, IndexError):
        raise Torn("message metadata is not a flatbuffer") from None
    if body_length < 0 or (tag == RECORD_BATCH and header_at < 0):
        raise Torn("message metadata is not a flatbuffer")
    return tag, header_at, body_length


def _decoded_size(meta: bytes, batch: int, body: memoryview) -> int:
    """Bytes a ``RecordBatch``'s buffers take once decoded: a compressed buffer starts with its
    decoded length (``-1``: stored as it is)."""
    try:
        buffers = _field(meta, batch, 2)
        compressed = _field(meta, batch, 3) is not None
        total = 0
        if buffers is None:
            return 0
        vec = buffers + _u32(meta, buffers)
        for i in range(_u32(meta, vec)):
            offset, length = struct.unpack_from("<qq", meta, vec + 4 + 16 * i)
            if offset < 0 or length < 0 or offset + length > len(body):
                raise Torn("a buffer lies outside its message")
            if compressed and length >= 8:
                declared = struct.unpack_from("<q", body, offset)[0]
                total += length - 8 if declared == -1 else max(declared, 0)
            else:
                total += length
        return total
    except (struct.error, IndexError):
        raise Torn("record batch metadata is not a flatbuffer") from None


def _u32(buf: bytes, at: int) -> int:
    return struct.unpack_from("<I", buf, at)[0]


def _field(buf: bytes, table: int, index: int) -> int | None:
    """Offset of field ``index`` of the flatbuffer table at ``table``; None when absent."""
    vtable = table - struct.unpack_from("<i", buf, table)[0]
    slot = 4 + 2 * index
    if vtable < 0 or slot + 2 > struct.unpack_from("<H", buf, vtable)[0]:
        return None
    offset = struct.unpack_from("<H", buf, vtable + slot)[0]
    return table + offset if offset else None
