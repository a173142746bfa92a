"""How a value travels from a rank to the notebook: one pickle, with each CPU tensor's bytes sent beside it.

torch pickles a tensor by saving its whole storage into a byte string inside the pickle, several copies on each
side. Here a plain CPU tensor becomes a pickle-5 out-of-band buffer instead: the rank writes its bytes straight
into the pipe, the kernel reads them into one preallocated bytearray and the tensor is rebuilt on that memory
without another copy. A result of any size costs about two memory copies (``python -m course_lib bench launch``
measures it).

On the wire: ``!Q`` length of the frame, then the frame: ``!I`` number of buffers, ``!Q`` pickle length, one
``!Q`` per buffer, the pickle, then each buffer starting at a multiple of ALIGN bytes from the frame's start.
"""

from __future__ import annotations

import io
import os
import pickle
import struct
import sys

import cloudpickle

LENGTH = struct.Struct("!Q")
_COUNTS = struct.Struct("!IQ")
ALIGN = 64  # any dtype's alignment, and a cache line


def _plain(t, torch) -> bool:
    """A tensor that is just bytes, shape and dtype (subclasses, autograd, sparse, quantized: torch's own way)."""
    return (type(t) is torch.Tensor and t.layout == torch.strided and t.device.type == "cpu"
            and not t.requires_grad and not t.is_quantized)


def _bytes_of(t, torch):
    flat = t.resolve_conj().resolve_neg().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def rebuild(buf, dtype, shape):
    """A tensor on ``buf``'s memory (no copy): the receiving side of _Pickler.reducer_override."""
    import torch

    if len(memoryview(buf)) == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).reshape(shape)


class _Pickler(cloudpickle.Pickler):
    def reducer_override(self, obj):
        torch = sys.modules.get("torch")  # called for every object: no import, and no tensor without torch
        if torch is not None and _plain(obj, torch):
            return rebuild, (pickle.PickleBuffer(_bytes_of(obj, torch)), obj.dtype, tuple(obj.shape))
        return super().reducer_override(obj)


def encode(value) -> list:
    """The frame of ``value`` as a list of byte-like pieces (not joined: the tensors' bytes are not copied)."""
    buffers: list[pickle.PickleBuffer] = []
    out = io.BytesIO()
    _Pickler(out, protocol=5, buffer_callback=buffers.append).dump(value)
    body = out.getbuffer()
    views = [b.raw() for b in buffers]
    lengths = b"".join(LENGTH.pack(v.nbytes) for v in views)
    pieces = [b"", _COUNTS.pack(len(views), body.nbytes), lengths, body]
    size = sum(len(p) for p in pieces)
    for v in views:
        pad = -size % ALIGN
        pieces += [bytes(pad), v]
        size += pad + v.nbytes
    pieces[0] = LENGTH.pack(size)
    return pieces


def dumps(value) -> bytes:
    """The frame as one bytes object (a small reply, or a pull of a persistent rank's variable)."""
    return b"".join(encode(value))


def write(fd: int, value) -> None:
    """Write ``value``'s frame to a blocking file descriptor."""
    for piece in encode(value):
        view = memoryview(piece).cast("B")
        while view.nbytes:
            view = view[os.write(fd, view) :]


def decode(frame) -> object:
    """The value of a frame (without its leading length); tensors share the frame's memory."""
    view = memoryview(frame)
    n, body_len = _COUNTS.unpack_from(view)
    pos = _COUNTS.size
    lengths = [LENGTH.unpack_from(view, pos + i * LENGTH.size)[0] for i in range(n)]
    pos += n * LENGTH.size
    body = view[pos : pos + body_len]
    pos += body_len
    buffers = []
    for length in lengths:
        pos += -pos % ALIGN
        buffers.append(view[pos : pos + length])
        pos += length
    return pickle.loads(body, buffers=buffers)


def loads(data) -> object:
    """The value of a frame made by dumps() (copied once if read-only: a tensor must own writable memory)."""
    view = memoryview(data)
    return decode((view if not view.readonly else memoryview(bytearray(view)))[LENGTH.size :])


def _buffer(n: int):
    """Writable memory for a frame: torch's, uninitialised, when torch is loaded (a bytearray is zeroed first,
    one more pass over a large result); a bytearray otherwise."""
    torch = sys.modules.get("torch")
    if torch is not None and n >= 1 << 20:
        return torch.empty(n, dtype=torch.uint8).numpy()
    return bytearray(n)


class Receiver:
    """Reads one frame from a non-blocking pipe as it arrives, straight into a buffer of the right size."""

    def __init__(self):
        self.head = b""
        self.frame = None  # the buffer, once the length is known
        self.got = 0

    @property
    def complete(self) -> bool:
        return self.frame is not None and self.got == len(self.frame)

    def feed_from(self, fd: int) -> bool:
        """Read what the pipe holds now; False at end of file."""
        while True:
            try:
                if self.frame is None:
                    data = os.read(fd, LENGTH.size - len(self.head))
                    self.head += data
                    if len(self.head) == LENGTH.size:
                        self.frame = _buffer(LENGTH.unpack(self.head)[0])
                    got = len(data)
                elif self.complete:
                    got = len(os.read(fd, 1))  # only the end of file can follow a frame
                else:
                    got = os.readv(fd, [memoryview(self.frame)[self.got :]])
                    self.got += got
            except BlockingIOError:
                return True
            if not got:
                return False

    def value(self):
        return decode(self.frame) if self.complete else None
