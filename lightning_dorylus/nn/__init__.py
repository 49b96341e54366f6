"""Dorylus GNN layers, written as Scatter / Gather (graph server) and ApplyVertex / ApplyEdge (executor)."""

from lightning_dorylus.nn.base import DorylusLayer, DorylusRuntime
from lightning_dorylus.nn.gat_conv import GATConv
from lightning_dorylus.nn.gcn_conv import GCNConv
from lightning_dorylus.nn.sage_conv import SAGEConv

__all__ = ["DorylusLayer", "DorylusRuntime", "GATConv", "GCNConv", "SAGEConv"]
