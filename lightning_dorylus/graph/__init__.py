"""Graph operations that run on the graph server: Scatter (SC) and the structures Gather (GA) uses (GA itself
runs inside the layers' autograd nodes, ``lightning_dorylus.nn.functions``)."""

from lightning_dorylus.graph.exchange import GhostExchange
from lightning_dorylus.graph.structure import (
    AdjacencyBlock,
    GCNAdjacency,
    GraphCache,
    GraphContext,
    SelfLoopEdges,
    gcn_adjacency,
    mean_adjacency,
    self_loop_edges,
)

__all__ = [
    "AdjacencyBlock",
    "GCNAdjacency",
    "GhostExchange",
    "GraphCache",
    "GraphContext",
    "SelfLoopEdges",
    "gcn_adjacency",
    "mean_adjacency",
    "self_loop_edges",
]
