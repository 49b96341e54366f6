"""Dorylus: full-graph GNN training split into graph operations (on graph servers) and tensor
operations (on serverless executors).

``import lightning_dorylus`` registers ``Trainer(strategy="dorylus")`` (and ``"dorylus_inline"``)
with Lightning.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lbd_common._warnings import filter_lightning_leafspec_warning
from lightning_dorylus.models import GAT, GCN, GraphSAGE
from lightning_dorylus.strategy import DorylusStrategy

filter_lightning_leafspec_warning()
DorylusStrategy.register_strategies(StrategyRegistry)  # guarded: a second import registers nothing

__all__ = ["GAT", "GCN", "DorylusStrategy", "GraphSAGE"]
