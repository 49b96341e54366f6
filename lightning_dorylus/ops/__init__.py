"""Numpy-only tensor operations (ApplyVertex, ApplyEdge and their backwards) and their handler.

This package, with ``lightning_dorylus/wire.py``, is what runs in executors (local worker processes, AWS
Lambda). It must never import torch; ``bundle`` lists and copies the files. ``OpSpec`` and
``register_ops`` are the public way to add an op from your own module (see ``registry``).
"""

from .registry import register_ops
from .spec import OpSpec

__all__ = ["OpSpec", "register_ops"]
