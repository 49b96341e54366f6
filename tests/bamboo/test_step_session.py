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
from lightning_bamboo.step.session import Reform, Retry, StepSession


class FakeRuntime:
    """The membership and its transitions as the loop sees them: which errors a lost peer caused, the
    re-forms asked for and run (a re-form may itself be cut by a lost peer: ``form_errors``)."""

    def __init__(self, lost: tuple[type[BaseException], ...], form_errors: list[BaseException] | None = None
                 ) -> None:
        self.lost = lost
        self.aborted_since: list[float] = []
        self.formed: list[Reform] = []
        self.form_errors = list(form_errors or [])
        self.owners = SimpleNamespace(generation=0)

    def attempt(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def generation_ended(self, err: BaseException, step: int) -> bool:
        return isinstance(err, self.lost)

    def aborted(self, session: StepSession, since: float) -> Reform:
        self.aborted_since.append(since)
        return Reform(self.owners, since)  # type: ignore[arg-type]

    def form(self, session: StepSession, reform: Reform) -> None:
        if self.form_errors:
            raise self.form_errors.pop(0)
        self.formed.append(reform)


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
    made.members = made.transitions = runtime  # type: ignore[assignment]
    return made


def attempts(*outcomes: Any) -> Any:
    """An attempt that raises or returns each of ``outcomes`` in turn."""
    pending = list(outcomes)

    def attempt() -> Any:
        outcome = pending.pop(0)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    return attempt


def test_a_lost_peer_undoes_the_step_forms_the_next_generation_and_runs_the_attempt_again() -> None:
    runtime = FakeRuntime(lost=(ConnectionError,))
    attempt = attempts(ConnectionError("peer gone"), ConnectionError("again"), "done")
    assert session(runtime).retrying(attempt) == "done"
    assert len(runtime.aborted_since) == 2 and runtime.aborted_since == sorted(runtime.aborted_since)
    # each loss's re-form ran, inside the loop, before the attempt ran again
    assert [r.since for r in runtime.formed] == runtime.aborted_since


def test_a_peer_lost_while_the_next_generation_forms_forms_again_without_undoing_twice() -> None:
    """The re-form is a pending step of the one loop: cut by another loss, it runs again (towards the newest
    generation) with the same ``since``; the step is undone once and never re-entered from inside."""
    runtime = FakeRuntime(lost=(ConnectionError,), form_errors=[ConnectionError("lost while forming")])
    attempt = attempts(ConnectionError("peer gone"), "done")
    assert session(runtime).retrying(attempt) == "done"
    assert len(runtime.aborted_since) == 1
    assert [r.since for r in runtime.formed] == runtime.aborted_since


def test_an_error_while_forming_that_no_lost_peer_caused_is_raised() -> None:
    runtime = FakeRuntime(lost=(ConnectionError,), form_errors=[ValueError("a bug while forming")])
    with pytest.raises(ValueError, match="a bug while forming"):
        session(runtime).retrying(attempts(ConnectionError("peer gone"), "done"))


def test_a_boundary_re_form_runs_in_the_loop_and_none_forms_nothing() -> None:
    runtime = FakeRuntime(lost=(ConnectionError,), form_errors=[ConnectionError("lost while forming")])
    made = session(runtime)
    made.form(None)
    assert runtime.formed == []
    reform = Reform(runtime.owners, 1.0, drain=True)  # type: ignore[arg-type]
    made.form(reform)
    assert runtime.formed == [reform] and runtime.aborted_since == []


def test_an_error_of_the_training_code_is_raised_without_recovering() -> None:
    runtime = FakeRuntime(lost=(ConnectionError,))

    def attempt() -> None:
        raise ValueError("a bug in training_step")

    with pytest.raises(ValueError, match="a bug in training_step"):
        session(runtime).retrying(attempt)
    assert runtime.aborted_since == [] and runtime.formed == []


def test_a_known_abort_and_a_roll_forward_go_through_lost() -> None:
    """``Retry`` (an abort read from the commit) reaches ``lost`` without asking the membership; ``lost``
    returns the re-form to run (an abort) or the value to return instead (a step the others committed)."""
    runtime = FakeRuntime(lost=())
    seen: list[Any] = []
    attempt = attempts(Retry("abort"), Retry("commit"))

    def lost(err: BaseException, since: float) -> str | Reform:
        seen.append(err.args[0])
        return "rolled forward" if err.args[0] == "commit" else Reform(runtime.owners, since)  # type: ignore[arg-type]

    assert session(runtime).retrying(attempt, lost) == "rolled forward"
    assert seen == ["abort", "commit"] and runtime.aborted_since == [] and len(runtime.formed) == 1


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
