"""Narrow filters, installed on import, for warnings that a user of this package cannot act on.

torch >= 2.10 deprecates constructing ``torch.utils._pytree.LeafSpec``, which Lightning 2.6's
``lightning.pytorch.utilities._pytree`` still does for every dataloader (a ``FutureWarning`` per loop). Only
that message, from that module, is hidden: the same deprecation from any other code still shows.
"""

from __future__ import annotations

import warnings

LEAFSPEC_MESSAGE = r"`isinstance\(treespec, LeafSpec\)` is deprecated"
LEAFSPEC_MODULE = r"lightning\.pytorch\.utilities\._pytree"


def filter_lightning_leafspec_warning() -> None:
    """Ignores the ``LeafSpec`` ``FutureWarning`` raised from inside Lightning's ``_pytree`` (idempotent)."""
    warnings.filterwarnings(
        "ignore", message=LEAFSPEC_MESSAGE, category=FutureWarning, module=LEAFSPEC_MODULE
    )
