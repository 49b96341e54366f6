"""A tensor-op worker process: read a request from stdin, run the handler, write the response to stdout.

Run by ``LocalPoolExecutor`` as ``python -S -m lightning_dorylus.executors.worker`` inside a handler
bundle (see ``lightning_dorylus.ops.bundle``), so it imports exactly what a Lambda function has:
the standard library, numpy, ``wire`` and ``ops``. Never torch, never pickle.

Protocol: messages are wire payloads (``lightning_dorylus.wire``), which are self-delimiting: the
24-byte prefix carries the total length. On start the worker imports the bundle's user op modules and sends
a hello ``{"ready": true, "pid"}`` (or ``{"ready": false, "error"}`` and exits if an import failed);
then for each request it answers ``{"op", "ok": true}`` + outputs, or ``{"op", "ok": false,
"error_type", "message"}`` if the op raised. EOF on stdin means the pool is closing: exit 0. A corrupt
prefix (bad magic, a length over ``wire.MAX_MESSAGE_SIZE``) is answered with a ``WireError`` reply and the
worker exits, since the stream cannot be resynchronized; nothing is allocated from an unchecked length.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterable
from typing import Any, BinaryIO

from lightning_dorylus import wire
from lightning_dorylus.ops import handlers, registry, shipped


class ReadBuffer:
    """One receive buffer reused across messages, grown (by a new allocation) to the largest so far."""

    def __init__(self) -> None:
        self.data = bytearray()

    def view(self, size: int) -> memoryview:
        if len(self.data) < size:
            self.data = bytearray(size)  # a new one: views of the old one (if any survive) stay valid
        return memoryview(self.data)[:size]


def read_message(stream: BinaryIO, max_size: int | None = None,
                 reuse: ReadBuffer | None = None) -> bytearray | memoryview | None:
    """Read one wire payload into a fresh ``bytearray`` (so decoded arrays are writable); None on EOF.

    The prefix's length is untrusted: ``wire.read_prefix`` rejects (``WireError``) a ``total_len`` over
    ``max_size`` (default ``wire.MAX_MESSAGE_SIZE``) before anything is allocated for the body.

    ``reuse``: read into this buffer instead (grown to the largest message so far) and return a memoryview
    of the payload, valid until the next call. The worker answers one request at a time, so its requests
    (an interval is MBs) need not each cost a fresh, zero-filled, page-faulted allocation.
    """
    prefix = _read_exact(stream, bytearray(wire.PREFIX_SIZE), allow_eof=True)
    if prefix is None:
        return None
    _, total_len = wire.read_prefix(prefix, max_size)
    buf = bytearray(total_len) if reuse is None else reuse.view(total_len)
    buf[: wire.PREFIX_SIZE] = prefix
    _read_exact(stream, memoryview(buf)[wire.PREFIX_SIZE:], allow_eof=False)
    return buf


def write_message(stream: BinaryIO, frames: Iterable[Any]) -> None:
    """Write a payload's frames (see ``wire.encode_frames``) completely, then flush."""
    for frame in frames:
        view = memoryview(frame).cast("B")
        while view.nbytes:
            written = stream.write(view)
            if written is None:  # a non-blocking stream that would block; ours are blocking pipes
                raise BlockingIOError("pipe would block")
            view = view[written:]
    stream.flush()


def _read_exact(stream: BinaryIO, buf: bytearray | memoryview,
                allow_eof: bool) -> bytearray | memoryview | None:
    view = memoryview(buf).cast("B")
    got = 0
    while got < view.nbytes:
        n = stream.readinto(view[got:])  # type: ignore[attr-defined]
        if not n:
            if got == 0 and allow_eof:
                return None
            raise EOFError(f"stream closed after {got} of {view.nbytes} bytes")
        got += n
    return buf


def serve(inp: BinaryIO, out: BinaryIO) -> None:
    """Answer requests until EOF on ``inp``, or a corrupt prefix (answered with an error, then return).

    First the bundle's user op modules (``ops/shipped.py``) are imported; one that fails is reported in
    the hello (``{"ready": false, "error"}``) and the worker exits.
    """
    try:
        registry.import_op_modules(shipped.OP_MODULES)
    except Exception as err:
        error = f"importing op modules {list(shipped.OP_MODULES)} failed: {type(err).__name__}: {err}"
        write_message(out, wire.encode_frames({"ready": False, "pid": os.getpid(), "error": error}, {})[1])
        return
    write_message(out, wire.encode_frames({"ready": True, "pid": os.getpid()}, {})[1])
    buffer = ReadBuffer()  # every request is read into it: its reply is written before the next read
    while True:
        try:
            payload = read_message(inp, reuse=buffer)
        except wire.WireError as err:  # corrupt prefix: the stream cannot be resynchronized; answer, stop
            write_message(out, wire.encode_frames(handlers.error_header(None, err), {})[1])
            return
        if payload is None:
            return
        try:
            _, frames = handlers.handle_frames(payload)
        except Exception as err:  # report it to the caller; the worker stays up
            op = _op_name(payload)
            _, frames = wire.encode_frames(handlers.error_header(op, err), {})
        del payload
        write_message(out, frames)


def _op_name(payload: bytearray | memoryview) -> Any:
    try:
        return wire.decode(payload)[0].get("op")
    except Exception:
        return None


def main() -> None:
    # The pool owns shutdown (it closes stdin); Ctrl-C in a terminal must not kill workers mid-reply.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Keep the protocol stream private: anything printed (warnings, debug) goes to stderr instead.
    out = os.fdopen(os.dup(sys.stdout.fileno()), "wb", buffering=0)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    inp = os.fdopen(os.dup(sys.stdin.fileno()), "rb", buffering=0)
    serve(inp, out)  # type: ignore[arg-type]


if __name__ == "__main__":
    main()
