"""Preflight advisor: which configuration to train *this* job in on spot nodes, from its own first steps.

    Trainer(strategy="bamboo", callbacks=[AdvisorProbe("bamboo_costs.json")]).fit(model, data)
    python -m lightning_bamboo.advise --costs bamboo_costs.json [--trace TRACE] [--plot FILE]

``AdvisorProbe`` measures the job's steps (per stage: compute, redundant forward, bubble; state bytes; a
checkpoint; start-up) and writes a costs file in the replay's format; the advisor replays the trace for every
candidate configuration (``lightning_bamboo.simulate``) and recommends the most samples per dollar, validated
against the same run's later steps. docs/bamboo-advise.md.
"""

from lightning_bamboo.advise.advisor import Advice, Candidate, advise
from lightning_bamboo.advise.probe import AdvisorProbe

__all__ = ["Advice", "AdvisorProbe", "Candidate", "advise"]
