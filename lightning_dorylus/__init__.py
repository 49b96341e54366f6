"""Dorylus: full-graph GNN training split into graph operations (on graph servers) and tensor
operations (on serverless executors).

``import lightning_dorylus`` registers ``Trainer(strategy="dorylus")`` with Lightning.
"""

__all__: list[str] = []
