"""The environment Bamboo's workers need on NCCL, so that a lost peer is a failover and not a lost job.

torch's defaults are made for jobs that end at the first failure; Bamboo's survivors must live through one
(:mod:`lightning_bamboo.runtime.release`). The supervisor and the agents start NCCL workers with
:data:`NCCL_ENV` (a value the user exported wins; ``BAMBOO_NCCL_ENV=0`` starts them with torch's defaults);
under another launcher (torchrun, SLURM) a worker on NCCL warns at start, naming what is missing
(:func:`missing`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

OPT_OUT = "BAMBOO_NCCL_ENV"  # "0": start the workers with torch's NCCL defaults (to measure what they do)
BACKEND = "BAMBOO_BACKEND"  # the workers' backend when the launcher cannot know it ("nccl", "gloo", ...)

NCCL_ENV: dict[str, str] = {
    # torch's default (3) tears the process down ~60 s after its watchdog sees an NCCL error or a timed-out
    # operation (it sleeps 4 x TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC, then rethrows on the watchdog thread):
    # every survivor of a lost peer would die in the middle of its failover. 0: errors are left to Bamboo.
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0",
    # on a timeout the watchdog would first dump its flight recorder, which waits on the same dead peer
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
    # how long the watchdog waits for that dump before acting: small, so nothing waits on it
    "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "100",
    # a CUDA error seen by the watchdog would be rethrown on its thread and end the process; Bamboo checks
    # the device itself after an abort (a sticky error ends the worker with a message that says so)
    "TORCH_NCCL_RETHROW_CUDA_ERRORS": "0",
    # NVLink SHARP's multicast objects are not released cleanly by an abort (torchft and
    # nvidia-resiliency-ext run fault-tolerant jobs without it); the cost is that collectives do not use it
    "NCCL_NVLS_ENABLE": "0",
}


def uses_nccl(backend: str | None) -> bool:
    """Whether ``backend`` (``"nccl"``, ``"cpu:gloo,cuda:nccl"``, ...) runs NCCL (``nccl-like`` does not)."""
    return backend is not None and any(b.split(":")[-1] == "nccl" for b in backend.split(","))


def workers_backend(environ: Mapping[str, str] | None = None) -> str:
    """The backend the launcher's workers will use: ``BAMBOO_BACKEND`` when set (Bamboo's own launcher of a
    plain ``python train.py`` sets it from the strategy), else NCCL on a machine with a CUDA device."""
    environ = os.environ if environ is None else environ
    if environ.get(BACKEND):
        return environ[BACKEND]
    import torch

    return "nccl" if torch.cuda.is_available() else "gloo"


def for_workers(backend: str, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """What a launcher adds to its workers' environment for ``backend``: :data:`NCCL_ENV` on NCCL, less the
    variables ``environ`` (default: this process's) already sets; nothing with ``BAMBOO_NCCL_ENV=0``."""
    environ = os.environ if environ is None else environ
    if not uses_nccl(backend) or environ.get(OPT_OUT) == "0":
        return {}
    return {key: value for key, value in NCCL_ENV.items() if key not in environ}


def missing(environ: Mapping[str, str] | None = None) -> list[str]:
    """The variables of :data:`NCCL_ENV` that ``environ`` leaves unset (a worker under another launcher)."""
    environ = os.environ if environ is None else environ
    return [key for key in NCCL_ENV if key not in environ]


def warning(names: list[str]) -> str:
    """The start-up warning for a worker on NCCL whose environment lacks ``names``."""
    exports = " ".join(f"{name}={NCCL_ENV[name]}" for name in names)
    return (
        f"Bamboo on NCCL: {', '.join(names)} not set, so torch's defaults apply and a lost peer can end the "
        f"survivors too (the watchdog tears a process down ~60 s after an NCCL error). Bamboo's launcher "
        f"sets them; under another launcher (torchrun, SLURM) export them: {exports}"
    )
