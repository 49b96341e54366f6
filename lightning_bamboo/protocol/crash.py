"""A worker that fails: a lost peer (the job fails over) or an error in the training code (the job stops).

An error in the training code (a bug in the user's module, a setting the runtime cannot train) is
deterministic: handled as a lost peer, the member that takes the failed stage over raises it again, and the
job dies after a chain of failovers, each printing the same traceback. So a worker tells the two apart:

* a *communication error* is what a lost or cut peer causes; the worker waits for the supervisor's next
  generation, as before. Checked by experiment on torch 2.13 with gloo: a peer SIGKILLed during
  ``send``/``recv``/``irecv``/``all_reduce``, or its connections shut down by the cutter, gives a plain
  ``RuntimeError`` "[.../gloo/transport/tcp/pair.cc:553] Connection closed by peer"; a peer alive but silent
  gives ``RuntimeError`` "[.../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 3000ms for recv
  operation to complete"; a collective after this member's own groups were aborted gives ``ValueError``
  "Default process group has not been initialized". ``torch.distributed.DistError`` (store, network,
  timeout errors), ``ConnectionError`` and ``TimeoutError`` count too, also as the cause or context of
  another exception;
* anything else is an error of the training code: the worker records it in the job's store
  (``error/{member}``: JSON with the member, exception type, message and traceback text) and raises it; the
  supervisor, seeing that worker exit non-zero with a record, stops the job instead of failing over
  (:mod:`lightning_bamboo.launch`). A worker killed by a signal stays a preemption.
"""

from __future__ import annotations

import json
import logging
import sys
import traceback
from typing import Any

import torch.distributed as dist

from lightning_bamboo.protocol import store as ms

log = logging.getLogger(__name__)

_MARKERS = (
    "gloo/transport",
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "Timed out waiting",
    "Default process group has not been initialized",
)


def is_communication_error(err: BaseException) -> bool:
    """Whether ``err`` (or what caused it) is what a lost peer causes, rather than an error of the code."""
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, (dist.DistError, ConnectionError, TimeoutError)):
            return True
        if isinstance(current, (RuntimeError, ValueError)) and any(m in str(current) for m in _MARKERS):
            return True
        current = current.__cause__ or current.__context__
    return False


def _key(member: int) -> str:
    return f"error/{member}"


_FIRST = "error/first"


def record(store: dist.Store, member: int, err: BaseException) -> int:
    """Record ``err`` as member ``member``'s failure (before the worker exits with it); returns the member
    whose error the job recorded first (this one, or one that failed before it)."""
    text = json.dumps(
        {
            "member": member,
            "type": type(err).__name__,
            "message": str(err),
            "traceback": "".join(traceback.format_exception(err)),
        }
    )
    store.set(_key(member), text)
    return int(store.compare_set(_FIRST, "", str(member)).decode())


def report_once(err: BaseException, member: int, first: dict[str, Any]) -> None:
    """When ``err`` is the error member ``first["member"]`` already failed with (same type and message: a
    mistake every worker meets, such as a batch size the pipelines cannot split), this worker prints one line
    for it at exit instead of the same traceback again; the first member prints the traceback, the
    supervisor names it. Another error is printed in full, as always.

    Python's ``sys.excepthook`` is what prints an uncaught exception; it is wrapped for this one exception
    object only."""
    if (type(err).__name__, str(err)) != (first["type"], first["message"]):
        return
    previous = sys.excepthook
    line = str(err).splitlines()[0] if str(err) else ""

    def hook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
        if value is not err:
            previous(kind, value, tb)
            return
        print(f"[bamboo] member {member}: {kind.__name__}: {line} (the error member {first['member']} failed "
              "with first; its traceback is printed once)", file=sys.stderr, flush=True)

    sys.excepthook = hook


def recorded(store: dist.Store, member: int) -> dict[str, Any] | None:
    """Member ``member``'s recorded failure, if it recorded one."""
    if not store.check([_key(member)]):
        return None
    return dict(json.loads(ms.get_str(store, _key(member))))


class Spare(RuntimeError):
    """This member has no stage in the new generation: it leaves (not an error of the training code)."""


def record_exception(store: dist.Store | None, member: int, exception: BaseException) -> None:
    """``fit`` ends with ``exception``: unless a lost peer caused it, record it in the job's store, so the
    supervisor stops the job with it instead of failing over."""
    if store is None or isinstance(exception, (SystemExit, KeyboardInterrupt, Spare)):
        return
    if is_communication_error(exception):
        return
    try:
        first = record(store, member, exception)
        earlier = recorded(store, first) if first != member else None
    except Exception as err:  # the supervisor is gone: nobody to tell
        log.warning("Bamboo member %d: could not record its error in the store: %s", member, err)
        return
    if earlier is not None:  # every worker met the same error: its traceback once, not once per worker
        report_once(exception, member, earlier)
