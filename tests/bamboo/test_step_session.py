"""The step session's one retry loop and the event bus, each on its own (no process group, no Trainer)."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from lightning_bamboo.runtime.events import Events
from lightning_bamboo.runtime.formation import Formation
from lightning_bamboo.runtime.generation import Generation
from lightning_bamboo.step.session import Retry, StepSession


class FakeRuntime:
    """The membership side of the loop: which errors a lost peer caused, and what recovering did."""

    def __init__(self, lost: tuple[type[BaseException], ...]) -> None:
        self.lost = lost
        self.recovered: list[float] = []

    def attempt(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def generation_ended(self, err: BaseException) -> bool:
        return isinstance(err, self.lost)

    def recover(self, since: float) -> None:
        self.recovered.append(since)


def session(runtime: FakeRuntime, calls: list[dict[str, Any]] | None = None) -> StepSession:
    seen = calls if calls is not None else []
    hook = SimpleNamespace(on_step_phase=lambda *args, **payload: seen.append(payload))
    trainer = SimpleNamespace(callbacks=[hook], lightning_module=None)
    formation = Formation(2, 2, True, True, None, device=lambda: torch.device("cpu"),
                          replica_device=lambda: torch.device("cpu"))
    events = Events(lambda: trainer)  # type: ignore[arg-type,return-value]
    made = StepSession(
        Generation(num_stages=2), formation, events, trainer=lambda: trainer,  # type: ignore[arg-type,return-value]
        precision=lambda: None, device=lambda: torch.device("cpu"),  # type: ignore[arg-type,return-value]
    )
    made.runtime = runtime  # type: ignore[assignment]
    return made


def test_a_lost_peer_recovers_and_runs_the_attempt_again() -> None:
    runtime = FakeRuntime(lost=(ConnectionError,))
    outcomes: list[Any] = [ConnectionError("peer gone"), ConnectionError("again"), "done"]

    def attempt() -> str:
        outcome = outcomes.pop(0)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    assert session(runtime).retrying(attempt) == "done"
    assert len(runtime.recovered) == 2 and runtime.recovered == sorted(runtime.recovered)


def test_an_error_of_the_training_code_is_raised_without_recovering() -> None:
    runtime = FakeRuntime(lost=(ConnectionError,))

    def attempt() -> None:
        raise ValueError("a bug in training_step")

    with pytest.raises(ValueError, match="a bug in training_step"):
        session(runtime).retrying(attempt)
    assert runtime.recovered == []


def test_a_known_abort_and_a_roll_forward_go_through_lost() -> None:
    """``Retry`` (an abort read from the commit) reaches ``lost`` without asking the runtime; ``lost``'s
    value (a step the others committed) is returned instead of running the attempt again."""
    runtime = FakeRuntime(lost=())
    seen: list[Any] = []
    attempts = iter([Retry("abort"), Retry("commit")])

    def attempt() -> str:
        raise next(attempts)

    def lost(err: BaseException, since: float) -> str | None:
        seen.append(err.args[0])
        return "rolled forward" if err.args[0] == "commit" else None

    assert session(runtime).retrying(attempt, lost) == "rolled forward"
    assert seen == ["abort", "commit"] and runtime.recovered == []


def test_phases_are_muted_during_a_fallback_rerun() -> None:
    calls: list[dict[str, Any]] = []
    made = session(FakeRuntime(lost=()), calls)
    made.step = 3
    made.phase("exchange")
    made._events.muted = True
    made.phase("prepared")
    assert calls == [{"phase": "exchange", "step": 3, "member": 0}]


def test_emitting_without_a_trainer_names_the_event() -> None:
    with pytest.raises(RuntimeError, match="cannot emit 'on_failover'"):
        Events(lambda: None).emit("on_failover", old_map=None, new_map=None)
