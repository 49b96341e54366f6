"""Graph operations that run on the graph server: Gather (GA), Scatter (SC) and the structures they use."""

from lightning_dorylus.graph.exchange import GhostExchange
from lightning_dorylus.graph.gather import attention_gather, gcn_gather, mean_gather
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
    "attention_gather",
    "gcn_adjacency",
    "gcn_gather",
    "mean_adjacency",
    "mean_gather",
    "self_loop_edges",
]
