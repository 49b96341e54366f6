"""Bamboo: pipeline-parallel training that survives preemption through redundant computation.

``import lightning_bamboo`` registers ``Trainer(strategy="bamboo")`` with Lightning.
"""

__all__: list[str] = []
