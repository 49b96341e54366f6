"""``GCN``: Kipf & Welling's two-layer GCN for node classification, built from Dorylus ``GCNConv`` layers."""

from __future__ import annotations

from lightning_dorylus.models.stacked import StackedConvClassifier
from lightning_dorylus.nn import GCNConv


class GCN(StackedConvClassifier):
    """``dropout -> GCNConv(relu) -> ... -> dropout -> GCNConv(logits)`` (PyG's ``examples/gcn.py``).

    Args: as :class:`StackedConvClassifier` (``hidden_channels=16`` for Cora).
    """

    conv_class = GCNConv
