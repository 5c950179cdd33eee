"""O_DIRECT support: the once-per-directory probe, aligned buffers, exact positional I/O.

O_DIRECT needs the buffer address, file offset and length all aligned (4096 covers every device we
target). `alloc_aligned` gives page-aligned anonymous memory (mmap) that callers use for staging, so
reads land in their buffers without a bounce copy. Positional I/O here never accepts a short
transfer: a short read is a truncated file, a short write is an error.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import uuid
from pathlib import Path
from typing import Any

from sgl_hicache.tier.format import ALIGN

O_DIRECT = getattr(os, "O_DIRECT", 0)


class ShortIO(OSError):
    """A read or write transferred fewer bytes than asked (truncated file, full device)."""


def alloc_aligned(nbytes: int) -> memoryview:
    """Zeroed, page-aligned, writable memory of `nbytes` (>= 1), freed when the view is dropped."""
    return memoryview(mmap.mmap(-1, max(nbytes, 1)))[:nbytes]


def address(buf: memoryview) -> int:
    """Address of the first byte of a writable, contiguous buffer."""
    if buf.nbytes == 0:
        return 0
    return ctypes.addressof(ctypes.c_char.from_buffer(buf.cast("B")))


def is_aligned(buf: memoryview) -> bool:
    return buf.nbytes % ALIGN == 0 and address(buf) % ALIGN == 0


def probe_direct_io(directory: Path) -> bool:
    """Whether files in `directory` accept O_DIRECT writes and reads (a 4096-byte test file)."""
    if not O_DIRECT:
        return False
    path = directory / f".probe.{uuid.uuid4().hex}{'.tmp'}"
    buf = alloc_aligned(ALIGN)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | O_DIRECT, 0o600)
        try:
            return os.pwrite(fd, buf, 0) == ALIGN and os.preadv(fd, [buf], 0) == ALIGN
        finally:
            os.close(fd)
    except OSError:
        return False
    finally:
        path.unlink(missing_ok=True)


def pread_exact(fd: int, buf: memoryview, offset: int) -> None:
    """Fill `buf` from `offset`; raises ShortIO at end of file."""
    done = 0
    while done < buf.nbytes:
        n = os.preadv(fd, [buf[done:]], offset + done)
        if n <= 0:
            raise ShortIO(f"short read: {done} of {buf.nbytes} bytes at offset {offset}")
        done += n


def pwrite_exact(fd: int, buf: memoryview | bytes, offset: int) -> None:
    """Write all of `buf` at `offset`; a short write is an error, never silently continued.

    The rest is tried once only to learn why (its OSError, e.g. ENOSPC, propagates); if that
    somehow succeeds, ShortIO is raised anyway."""
    view = memoryview(buf)
    n = os.pwrite(fd, view, offset)
    if n != view.nbytes:
        os.pwrite(fd, view[n:], offset + n)
        raise ShortIO(f"short write: {n} of {view.nbytes} bytes at offset {offset}")


def pwritev_exact(fd: int, bufs: list[memoryview], offset: int) -> None:
    """`pwrite_exact` of several buffers laid end to end, in one system call when it completes."""
    n = os.pwritev(fd, bufs, offset)
    total = sum(b.nbytes for b in bufs)
    if n == total:
        return
    pos = offset
    for b in bufs:  # write the rest to learn why (ENOSPC, ...): the failing write raises its OSError
        skip = max(0, offset + n - pos)
        if skip < b.nbytes:
            pwrite_exact(fd, b[skip:], pos + skip)
        pos += b.nbytes
    raise ShortIO(f"short write: {n} of {total} bytes at offset {offset}")


def as_view(buf: object, writable: bool) -> memoryview:
    """A flat byte view of a contiguous buffer (numpy array, bytearray, mmap, ...); raises ValueError."""
    try:
        view = memoryview(_tensor_bytes(buf) if hasattr(buf, "untyped_storage") else buf)  # type: ignore[arg-type]
    except (TypeError, RuntimeError) as e:
        raise ValueError(f"not a contiguous host buffer: {type(buf).__name__}: {e}") from e
    if not view.c_contiguous:
        raise ValueError("buffer must be C-contiguous")
    if writable and view.readonly:
        raise ValueError("destination buffer is read-only")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def _tensor_bytes(tensor: Any) -> Any:
    """A CPU torch tensor's bytes as a numpy array (raises TypeError/RuntimeError for GPU tensors)."""
    import torch

    return tensor.detach().view(torch.uint8).numpy()
