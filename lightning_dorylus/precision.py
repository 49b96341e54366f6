"""Which Lightning ``precision`` settings a Dorylus run supports, checked before the model is converted.

Tensor ops cross to the executors as numpy arrays (float16/32/64, no bfloat16) and the graph server's
sparse aggregation (torch CSR matmul) has no CPU half kernel; under autocast it receives bfloat16 and fails
deep in a layer. Full precision is what the exactness tests cover. Checked on CPU graph servers only: half or
mixed precision on CUDA is untested and left to the user.
"""

from __future__ import annotations

SUPPORTED_PRECISIONS = ("32-true", "64-true")


def check_precision(precision: str) -> None:
    """Raises naming ``Trainer(precision=...)`` unless it is ``"32-true"`` or ``"64-true"`` (CPU servers)."""
    if precision not in SUPPORTED_PRECISIONS:
        raise ValueError(
            f"Trainer(precision={precision!r}) is not supported by DorylusStrategy: tensor ops run as numpy "
            f"arrays on the executors and the sparse aggregation has no half kernel; use one of "
            f"{list(SUPPORTED_PRECISIONS)}"
        )
