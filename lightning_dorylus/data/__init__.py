"""Graph partitioning for Dorylus: one :class:`GraphPartition` per graph server, cached on disk.

Typical use::

    from lightning_dorylus.data import DorylusDataModule, load_planetoid
    datamodule = DorylusDataModule(load_planetoid("data/planetoid"), partitioner="metis")
    trainer = Trainer(strategy="dorylus", devices=2)  # num_parts defaults to trainer.world_size

Without a Trainer: ``partition_graph(data, num_parts)`` returns the partitions in memory, and
``partition_to_cache`` / ``load_partition`` write and read the on-disk cache (layout in ``cache.py``).
"""

from lightning_dorylus.data import synthetic
from lightning_dorylus.data.build import (
    DEFAULT_INTERVAL_SIZE,
    build_partitions,
    interval_ptr,
    partition_graph,
)
from lightning_dorylus.data.cache import (
    CorruptCacheError,
    default_cache_dir,
    load_graph,
    load_partition,
    partition_to_cache,
    read_meta,
    save_graph,
)
from lightning_dorylus.data.datamodule import DorylusDataModule, PartitionLoader
from lightning_dorylus.data.fingerprint import graph_fingerprint, graph_hash
from lightning_dorylus.data.partition import GraphPartition
from lightning_dorylus.data.partitioner import edge_cut, partition_nodes
from lightning_dorylus.data.planetoid import load_planetoid
from lightning_dorylus.data.validation import PARTITIONERS

__all__ = [
    "DEFAULT_INTERVAL_SIZE",
    "PARTITIONERS",
    "CorruptCacheError",
    "DorylusDataModule",
    "GraphPartition",
    "PartitionLoader",
    "build_partitions",
    "default_cache_dir",
    "edge_cut",
    "graph_fingerprint",
    "graph_hash",
    "interval_ptr",
    "load_graph",
    "load_partition",
    "load_planetoid",
    "partition_graph",
    "partition_nodes",
    "partition_to_cache",
    "read_meta",
    "save_graph",
    "synthetic",
]
