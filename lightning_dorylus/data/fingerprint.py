"""The input graph's fingerprint: its cache key, and the check that every graph server built the same graph.

Every Lightning process runs the user's script, so every graph server builds the graph itself. A graph that
comes out differently per process (an unseeded ``T.RandomNodeSplit``, random features or edges) would be
partitioned by rank 0 and looked up under another key by the others. :func:`check_same_graph` all-gathers
the per-field digests (an int64 tensor: no pickle) at ``setup`` and raises on every rank, naming the fields
and ranks that differ and the likely cause.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch_geometric.data import Data

from lightning_dorylus.data.validation import MASK_NAMES, check_features

FINGERPRINT_VERSION = 3
"""Bumped whenever what the digest covers changes (it is the partition cache key: old caches are not read).
3: ``edge_weight`` covered, and duplicate edges kept in the partitions (version 2 caches removed them)."""

GRAPH_FIELDS = ("edge_index", "edge_weight", "x", "y", *MASK_NAMES)
_DIGEST_BYTES = 32  # sha256


def graph_fingerprint(data: Data) -> dict[str, str]:
    """Hex sha256 per field of ``GRAPH_FIELDS`` (dtype, shape and raw bytes; ``"None"`` for a missing one)."""
    if isinstance(getattr(data, "x", None), Tensor):  # a sparse x fails here naming x, not in .contiguous()
        check_features(data.x, data.x.size(0))
    fingerprint = {}
    for name in GRAPH_FIELDS:
        value = getattr(data, name, None)
        if value is None:
            fingerprint[name] = "None"
            continue
        tensor = value.detach().cpu().contiguous()
        digest = hashlib.sha256(f"{name}:{tensor.dtype}:{tuple(tensor.shape)};".encode())
        digest.update(memoryview(tensor.reshape(-1).view(torch.uint8).numpy()))  # raw bytes, any dtype
        fingerprint[name] = digest.hexdigest()
    return fingerprint


def graph_hash(data: Data, fingerprint: dict[str, str] | None = None) -> str:
    """Hex sha256 of the graph's structure, features, labels, masks and ``num_nodes``: the cache key."""
    fingerprint = fingerprint if fingerprint is not None else graph_fingerprint(data)
    digest = hashlib.sha256(f"dorylus-graph-v{FINGERPRINT_VERSION};num_nodes={data.num_nodes};".encode())
    for name in GRAPH_FIELDS:
        digest.update(f"{name}={fingerprint[name]};".encode())
    return digest.hexdigest()


def check_same_graph(strategy: Any, digest: str, fingerprint: dict[str, str] | None = None) -> None:
    """Raises on every rank if the graph servers hold different graphs.

    Args:
        strategy: The Trainer's strategy (its ``root_device``; its ``all_gather`` where no torch.distributed
            group exists).
        digest: This process's :func:`graph_hash`.
        fingerprint: This process's :func:`graph_fingerprint` (``None`` for a partition directory: only the
            whole-graph digests are compared).
    """
    names = ("graph", *GRAPH_FIELDS)
    rows = [digest, *((fingerprint or {}).get(name, "") for name in GRAPH_FIELDS)]
    local = torch.stack([_to_words(row) for row in rows]).to(strategy.root_device)  # (fields, 4) int64
    gathered = _all_gather(strategy, local).cpu()  # (world_size, fields, 4)
    if bool((gathered == gathered[0]).all()):
        return
    differs = [r for r in range(gathered.size(0)) if not torch.equal(gathered[r, 0], gathered[0, 0])]
    if not differs:  # equal graphs, a field digest "None" vs "" (a partition directory): nothing to report
        return
    known = (gathered[:, 1:] != 0).any(dim=2).all(dim=0)  # fields every rank has a digest for
    fields = [
        names[1 + i] for i in range(len(GRAPH_FIELDS))
        if known[i] and not bool((gathered[:, 1 + i] == gathered[0, 1 + i]).all())
    ]
    hashes = ", ".join(f"rank {r}: {_to_hex(gathered[r, 0])[:12]}" for r in range(gathered.size(0)))
    which = f" ({', '.join(fields)} differ)" if fields else ""
    raise ValueError(
        f"the input graph differs between processes{which}: rank(s) {differs} built another graph than "
        f"rank 0 ({hashes}). Every process runs the script and builds the graph itself, so anything random "
        "in it must be seeded: most likely an unseeded split (T.RandomNodeSplit, RandomLinkSplit, a "
        "torch.randperm mask) or random generation (features, edges). Call lightning.seed_everything(...) "
        "before building the graph, or build it once and pass the saved file (save_graph) or a partition "
        "directory as data"
    )


def _all_gather(strategy: Any, local: Tensor) -> Tensor:
    """Every rank's ``local`` stacked, through torch.distributed's default group when there is one
    (Lightning's ``strategy.all_gather`` goes through the deprecated ``torch.distributed.nn.functional
    .all_gather`` and prints a warning on every rank), else through the strategy's own ``all_gather``."""
    if not (dist.is_available() and dist.is_initialized()):
        return strategy.all_gather(local)
    rows = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, local)
    return torch.stack(rows)


def _to_words(hex_digest: str) -> Tensor:
    """A 32-byte hex digest as four int64 words (zeros for ``""``/``"None"``: no digest)."""
    raw = bytes.fromhex(hex_digest) if len(hex_digest) == 2 * _DIGEST_BYTES else b""
    if hex_digest == "None":  # a missing field: a fixed non-zero marker, equal on every rank
        raw = hashlib.sha256(b"None").digest()
    raw = raw or bytes(_DIGEST_BYTES)
    return torch.frombuffer(bytearray(raw), dtype=torch.int64).clone()


def _to_hex(words: Tensor) -> str:
    return words.contiguous().numpy().tobytes().hex()
