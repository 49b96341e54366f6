"""Numpy-only tensor operations (ApplyVertex, ApplyEdge and their backwards) and their handler.

This package, with ``lightning_dorylus/wire.py``, is what runs in executors: local worker processes
today and AWS Lambda in part 2. It must never import torch; ``bundle`` lists and copies the files.
"""
