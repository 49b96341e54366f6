"""LightningModules that train on a :class:`~lightning_dorylus.data.GraphPartition` (one per graph server)."""

from lightning_dorylus.models.base import NodeClassifier
from lightning_dorylus.models.gat import GAT
from lightning_dorylus.models.gcn import GCN
from lightning_dorylus.models.sage import GraphSAGE

__all__ = ["GAT", "GCN", "GraphSAGE", "NodeClassifier"]
