"""``GraphSAGE``: a GraphSAGE node classifier (mean aggregator) from Dorylus ``SAGEConv`` layers."""

from __future__ import annotations

from lightning_dorylus.models.stacked import StackedConvClassifier
from lightning_dorylus.nn import SAGEConv


class GraphSAGE(StackedConvClassifier):
    """``dropout -> SAGEConv(relu) -> ... -> dropout -> SAGEConv(logits)`` (PyG's ``GraphSAGE``, full-batch).

    Args: as :class:`StackedConvClassifier`.
    """

    conv_class = SAGEConv
