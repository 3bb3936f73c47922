"""Host transfers: upload and download through the queue, ordered with the work recorded around them.

Where device memory is host-visible (lavapipe, integrated GPUs) a transfer is a memcpy through the mapped
buffer after waiting for the GPU's last use of it; elsewhere it goes through pooled staging buffers (upload) and
host-cached readback buffers (download), STAGING_CHUNK bytes at a time, as copies recorded in the command stream.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

import numpy as np

from .errors import CaptureError
from .memory import Buffer, BufferView

if TYPE_CHECKING:
    from .device import Device

STAGING_CHUNK = 64 << 20  # bytes per staged copy

class Transfers:
    def __init__(self, device: Device) -> None:
        self.device = device
        self.memory = device.memory

    def upload(self, buf: Buffer | BufferView, data: Any, offset: int = 0) -> None:
        """Copy host bytes into `buf` at byte `offset`, ordered after work already recorded."""
        src = _as_bytes(data)
        nbytes = src.size
        if offset < 0 or offset + nbytes > buf.size:
            raise ValueError(f"upload of {nbytes} bytes at offset {offset} overflows a buffer of {buf.size} bytes")
        if nbytes == 0:
            return
        alloc, base = buf.alloc, buf.offset + offset
        queue = self.device.queue
        if alloc.host is not None:
            queue.wait_for(alloc)  # the GPU may still read the old contents
            alloc.host[base:base + nbytes] = src
            return
        for start in range(0, nbytes, STAGING_CHUNK):
            n = min(STAGING_CHUNK, nbytes - start)
            stage = self.memory.staging.alloc(n)
            stage.alloc.host[:n] = src[start:start + n]
            queue.copy(stage, 0, buf, offset + start, n, log=False)
            queue.hold(stage)
            if n == STAGING_CHUNK:
                queue.flush()

    def download_async(self, buf: Buffer | BufferView, dtype: Any, shape: tuple[int, ...]) -> HostCopy:
        """Start copying `buf`'s first bytes (an array of `shape`) to the host: the copy is recorded after the work
        already recorded and submitted now; `HostCopy.result()` waits for that submission only, so work submitted
        after it (the next step of a loop) keeps the GPU busy while the host reads."""
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if nbytes > min(buf.size, STAGING_CHUNK):
            raise ValueError(f"download_async of {nbytes} bytes from a buffer of {buf.size} bytes (at most "
                             f"{STAGING_CHUNK} bytes at a time)")
        queue = self.device.queue
        _refuse_in_capture(queue)
        stage = self.memory.readback.alloc(max(nbytes, 1))
        if nbytes:
            queue.copy(buf, 0, stage, 0, nbytes)
        queue.flush()
        return HostCopy(self.device, stage, dtype, tuple(shape))

    def download(self, buf: Buffer | BufferView, dtype: Any, shape: Any, offset: int = 0) -> np.ndarray:
        """A new numpy array of `buf`'s bytes from `offset`, once every recorded writer has finished."""
        dtype = np.dtype(dtype)
        if shape is None:
            shape = ((buf.size - offset) // dtype.itemsize,)
        elif isinstance(shape, (int, np.integer)):
            shape = (int(shape),)
        count = int(np.prod(shape, dtype=np.int64))
        nbytes = count * dtype.itemsize
        if offset < 0 or offset + nbytes > buf.size:
            raise ValueError(f"download of {nbytes} bytes at offset {offset} overflows a buffer of {buf.size} bytes")
        out = np.empty(nbytes, dtype=np.uint8)
        if nbytes:
            alloc, base = buf.alloc, buf.offset + offset
            queue = self.device.queue
            _refuse_in_capture(queue)
            if alloc.host is not None:
                queue.wait_for(alloc)
                out[:] = alloc.host[base:base + nbytes]
            else:
                for start in range(0, nbytes, STAGING_CHUNK):
                    n = min(STAGING_CHUNK, nbytes - start)
                    stage = self.memory.readback.alloc(n)
                    queue.copy(buf, offset + start, stage, 0, n)
                    queue.synchronize()
                    out[start:start + n] = stage.alloc.host[:n]
                    stage.release()
        return out.view(dtype).reshape(shape)


def _refuse_in_capture(queue: Any) -> None:
    """A read back to the host cannot be part of a capture (a replay could not repeat it): raise in the capturing
    thread."""
    if queue.capture is not None and queue.capture.thread == threading.get_ident():
        raise CaptureError("reading a buffer back to the host inside a capture: a replay could not repeat it (in a "
                           "jit-compiled function, call .numpy()/.item() on its outputs instead)")


def _as_bytes(data: Any) -> np.ndarray:
    if isinstance(data, np.ndarray):
        arr = np.ascontiguousarray(data)
        return arr.reshape(-1).view(np.uint8) if arr.size else np.empty(0, np.uint8)
    return np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)


class HostCopy:
    """A download on its way (Transfers.download_async): `result()` waits for the submission that copies it and
    returns a new array; dropping it unread returns its readback memory once the copy completes."""

    def __init__(self, device: Device | None, stage: Buffer | None, dtype: np.dtype, shape: tuple[int, ...]) -> None:
        self.device, self.stage, self.dtype, self.shape = device, stage, dtype, shape

    @classmethod
    def empty(cls, dtype: Any, shape: tuple[int, ...]) -> HostCopy:
        """The copy of an empty array: nothing to wait for."""
        return cls(None, None, np.dtype(dtype), tuple(shape))

    def result(self) -> np.ndarray:
        if self.device is None or self.stage is None:
            return np.zeros(self.shape, self.dtype)
        if self.device.lost or self.device.closed:
            self.device.check_usable()
        nbytes = int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize
        self.device.queue.wait_for(self.stage.alloc)
        out = np.array(self.stage.alloc.host[:nbytes], dtype=np.uint8)
        self.stage.release()
        return out.view(self.dtype).reshape(self.shape)
