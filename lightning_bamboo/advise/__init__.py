"""Preflight advisor (first cut): which configuration to train a measured job in on a spot trace.

    python -m lightning_bamboo.advise [--costs FILE] [--trace TRACE] [--plot FILE]

Reads the costs measured for a job (``benchmarks/bamboo_preemption.py [recipe overrides]`` writes them),
replays the trace for every candidate configuration the measurements cover (``lightning_bamboo.simulate``: the
model validated against that same run) and recommends the one with the most samples per dollar.
docs/bamboo-replay.md, "Preflight advisor".
"""

from lightning_bamboo.advise.advisor import Advice, Candidate, advise

__all__ = ["Advice", "Candidate", "advise"]
