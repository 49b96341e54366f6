"""``lightning_bamboo.testing``: the fault spec is parsed by the test-support callback, not by the runtime,
and the callback acts only on the phase, step and member it names."""

from __future__ import annotations

import signal
from types import SimpleNamespace

import pytest

from lightning_bamboo import testing
from lightning_bamboo.testing import Fault, PhaseFaults, parse_faults


def test_parse_faults() -> None:
    assert parse_faults("1:2:forward,0+3:4:commit:STOP") == [
        Fault((1,), 2, "forward", signal.SIGKILL),
        Fault((0, 3), 4, "commit", signal.SIGSTOP),
    ]
    assert parse_faults(None) == [] and parse_faults("") == []


@pytest.mark.parametrize("bad", ["1:2", "1:2:nowhere", "1:2:forward:KILL"])
def test_parse_faults_names_the_bad_item(bad: str) -> None:
    with pytest.raises(ValueError, match=rf"BAMBOO_FAULT must be member:step:phase\[:STOP\].*{bad!r}"):
        parse_faults(bad)


def test_acts_only_on_its_phase_step_and_member(monkeypatch: pytest.MonkeyPatch) -> None:
    kills: list[int] = []
    monkeypatch.setattr(testing.os, "kill", lambda pid, sig: kills.append(sig))
    monkeypatch.setattr(testing.time, "sleep", lambda s: None)
    trainer = SimpleNamespace(strategy=SimpleNamespace(engine=SimpleNamespace(num_microbatches=4)))
    faults = PhaseFaults(parse_faults("1:2:forward,1:3:prepared"))
    for phase, step, member, mb in [
        ("forward", 2, 0, 1), ("forward", 1, 1, 1), ("forward", 2, 1, 0), ("prepared", 2, 1, None)
    ]:
        faults.on_step_phase(trainer, None, phase, step, member, microbatch=mb)  # type: ignore[arg-type]
    assert kills == []
    faults.on_step_phase(trainer, None, "forward", 2, 1, microbatch=1)  # type: ignore[arg-type]
    faults.on_step_phase(trainer, None, "prepared", 3, 1)  # type: ignore[arg-type]
    assert kills == [signal.SIGKILL, signal.SIGKILL]


def test_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BAMBOO_FAULT", "2:5:applied:STOP")
    assert PhaseFaults.from_env().faults == [Fault((2,), 5, "applied", signal.SIGSTOP)]
    monkeypatch.delenv("BAMBOO_FAULT")
    assert PhaseFaults.from_env().faults == []
