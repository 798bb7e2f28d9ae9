"""One Arrow IPC stream appended to a file one whole message at a time.

Why not ``pyarrow.ipc.new_stream(open(path))``: when the disk fills, the stream writer has
already handed part of a batch to the file, and every batch after it lands behind a torn
message that readers must stop at. Here the writer encodes into memory; the bytes of each batch
go to the file with :func:`ddpmon.rundir.atomic.append_whole`, which cuts a short write back to the
last whole message. A failed batch therefore leaves the file exactly as it was (readable up to
its last good batch) and can simply be written again once there is space.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..rundir.atomic import append_whole


class _Memory:
    """The file-like object the Arrow writer writes to: bytes wait here until taken."""

    closed = False

    def __init__(self) -> None:
        self._buf = bytearray()

    def write(self, data: Any) -> int:
        self._buf += bytes(data)
        return len(data)

    def flush(self) -> None:
        pass

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return len(self._buf)

    def close(self) -> None:
        self.closed = True

    def take(self) -> bytes:
        data, self._buf = bytes(self._buf), bytearray()
        return data


class StreamAppender:
    """Appends one stream (schema, batches, end marker) to ``path``; ``truncate`` starts the file
    over, else a new stream follows what the file holds (readers accept several).

    The file is opened at the first batch, and a first batch that fails removes a file it left
    empty: a reader never finds a history file without even a schema."""

    def __init__(self, path: Path, schema: Any, options: Any, *, truncate: bool) -> None:
        self.path = Path(path)
        self._schema = schema
        self._options = options
        self._truncate = truncate
        self._fd: int | None = None
        self._closed = False
        self._memory = _Memory()
        self._writer: Any = None
        self._started = False
        """The schema message is in the file (a batch went out whole with it)."""

    def write_batch(self, batch: Any) -> None:
        """Append ``batch`` whole, or raise and leave the file as it was."""
        import pyarrow.ipc as ipc  # pyarrow loads on the history thread only

        if self._closed:
            raise ValueError(f"{self.path}: appender is closed")
        if self._fd is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | (os.O_TRUNC if self._truncate else 0)
            self._fd = os.open(self.path, flags, 0o644)
        if self._writer is None:
            self._writer = ipc.new_stream(self._memory, self._schema, options=self._options)
        self._writer.write_batch(batch)
        try:
            append_whole(self._fd, self._memory.take())
        except BaseException:
            if not self._started:  # the schema went with the failed bytes: write it again
                self._writer = None
                self._drop_if_empty()
            raise
        self._started = True

    def _drop_if_empty(self) -> None:
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            if os.fstat(fd).st_size == 0:
                self.path.unlink(missing_ok=True)
        except OSError:
            pass
        finally:
            os.close(fd)

    def fsync(self) -> None:
        if self._fd is not None:
            os.fsync(self._fd)

    def close(self) -> None:
        """Write the end-of-stream marker (if a batch went out) and close the file. A marker
        that does not fit is left out: readers take a stream without one."""
        self._closed = True
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            if self._writer is not None and self._started:
                self._writer.close()
                append_whole(fd, self._memory.take())
        except Exception:
            pass
        finally:
            os.close(fd)
