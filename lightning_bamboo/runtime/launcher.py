"""Elastic Bamboo from a plain script: ``python train.py`` whose Trainer has
``strategy="bamboo", devices=N`` survives a lost worker.

Lightning's own script launcher makes the script's process rank 0 and starts the other ranks; a preemption of
rank 0 would then end the job. Here the script's process becomes the job's *supervisor* instead
(:class:`lightning_bamboo.control.supervisor.Supervisor`: it serves the store, starts ``N`` workers that run
the same command, watches them and decides every membership change) and is not a training rank, so any worker
may be lost. When the job ends the script's process exits with the job's exit code: the code after
``trainer.fit`` runs in the workers, which hold the trained stages, not in the supervisor, which holds no
weights.

``python -m lightning_bamboo.launch --nproc N train.py`` stays the CLI (with ``--replace``, ``--store`` and
``--hang-timeout``); a script it starts is a worker and launches nothing.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from typing_extensions import override

from lightning_bamboo._lightning import private as _private
from lightning_bamboo.control.supervisor import Supervisor

if TYPE_CHECKING:
    import lightning.pytorch as pl


def script_command() -> list[str]:
    """The command line that started this process, to start each worker with (as Lightning's launcher does:
    ``python -m module args`` or ``python /abs/path/script.py args``; a Hydra app's workers write into this
    process's run directory, as Lightning's launcher arranges, instead of each making its own)."""
    spec = getattr(sys.modules["__main__"], "__spec__", None)
    if spec is not None and spec.name not in ("__main__", None):
        command = [sys.executable, "-m", spec.name, *sys.argv[1:]]
    else:
        command = [sys.executable, os.path.abspath(sys.argv[0]), *sys.argv[1:]]
    return command + _hydra_overrides()


def _hydra_overrides() -> list[str]:
    if "hydra" not in sys.modules:
        return []
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return []
    return [f'hydra.run.dir="{HydraConfig.get().run.dir}"', "hydra.output_subdir=null"]


class SupervisorLauncher(_private.Launcher):
    """Runs the job's supervisor in this process and exits with the job's code (see the module docstring).

    Args:
        nproc: workers to start (``Trainer(devices=N)``).
        hang_timeout: seconds without a heartbeat after which a worker is killed and counted as lost.
        preflight: called with the Trainer entry point's module (``fit(model)``'s ``model``) before any worker
            starts; an error it raises ends the script there, once (the strategy's checks of the module).
    """

    def __init__(
        self, nproc: int, hang_timeout: float = 5.0, preflight: Callable[[object], None] | None = None,
        backend: str | None = None,
    ) -> None:
        self.nproc = nproc
        self.backend = backend  # the workers' process-group backend (their environment follows it)
        self.hang_timeout = hang_timeout
        self.preflight = preflight
        self.supervisor: Supervisor | None = None

    @property
    @override
    def is_interactive_compatible(self) -> bool:
        return False  # the workers re-run the script

    @override
    def launch(self, function: Callable, *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any) -> Any:
        if self.preflight is not None and args:  # fit/validate/test/predict(model, ...)
            self.preflight(args[0])
        supervisor = Supervisor(script_command(), self.nproc, hang_timeout=self.hang_timeout,
                                backend=self.backend)
        self.supervisor = supervisor
        print(
            f"[bamboo.launch] this process supervises {self.nproc} workers (it trains nothing itself; the "
            "code after trainer.fit runs in the workers)",
            flush=True,
        )
        raise SystemExit(supervisor.run())

    @override
    def kill(self, signum: int) -> None:
        """Pass ``signum`` on to every live worker, by PID."""
        if self.supervisor is not None:
            for member in self.supervisor.live_members():
                self.supervisor.kill(member, signum)
