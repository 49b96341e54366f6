"""Graph partitioning for Dorylus: one :class:`GraphPartition` per graph server, cached on disk.

Typical use::

    from lightning_dorylus.data import DorylusDataModule, load_planetoid
    datamodule = DorylusDataModule(load_planetoid("data/planetoid"), partitioner="metis")
    trainer = Trainer(strategy="dorylus", devices=2)  # num_parts defaults to trainer.world_size

Without a Trainer: ``partition_graph(data, num_parts)`` returns the partitions in memory.
"""

from lightning_dorylus.data.build import DEFAULT_INTERVAL_SIZE, build_partitions, partition_graph
from lightning_dorylus.data.partition import GraphPartition
from lightning_dorylus.data.partitioner import edge_cut, partition_nodes
from lightning_dorylus.data.validation import PARTITIONERS

__all__ = [
    "DEFAULT_INTERVAL_SIZE",
    "PARTITIONERS",
    "GraphPartition",
    "build_partitions",
    "edge_cut",
    "partition_graph",
    "partition_nodes",
]
