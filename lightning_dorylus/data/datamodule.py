"""``DorylusDataModule``: partitions a graph once (cached on disk), then each process loads its own part.

One Lightning process is one graph server. ``prepare_data`` (local rank 0 of each node) partitions the
graph into the cache; after Lightning's ``pre_setup`` barrier, ``setup`` loads partition
``trainer.global_rank``. Every dataloader yields that one :class:`GraphPartition` once per epoch (full-graph
training: one step per epoch).

The loaders are :class:`PartitionLoader` objects, not ``DataLoader``: Lightning 2.6 only injects a
``DistributedSampler`` into ``DataLoader`` instances (``_DataConnector._prepare_dataloader``) and only checks
worker counts on them, so a partition is never split or duplicated across ranks.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from pathlib import Path

from lightning.pytorch import LightningDataModule
from torch_geometric.data import Data, InMemoryDataset
from typing_extensions import override

from lightning_dorylus.data.build import DEFAULT_INTERVAL_SIZE
from lightning_dorylus.data.cache import (
    cache_name,
    default_cache_dir,
    is_complete,
    load_graph,
    load_partition,
    partition_to_cache,
    read_meta,
)
from lightning_dorylus.data.chunked import ChunkedGraph
from lightning_dorylus.data.fingerprint import check_same_graph, graph_fingerprint, graph_hash
from lightning_dorylus.data.partition import GraphPartition
from lightning_dorylus.data.stream_assign import STREAM_PARTITIONERS
from lightning_dorylus.data.streaming import node_parts, prepare_streamed, streamed_name
from lightning_dorylus.data.validation import (
    IGNORED_EDGE_FIELDS,
    check_cache_dir,
    check_graph,
    check_interval_size,
    check_num_classes,
    check_partitioner,
    check_world_size,
    ignored_attributes,
    is_integer,
    is_multi_label,
    warn_ignored_attributes,
)


class PartitionLoader:
    """An iterable of length one that yields this process's partition (one full-graph step per epoch)."""

    def __init__(self, partition: GraphPartition) -> None:
        self.partition = partition

    def __iter__(self) -> Iterator[GraphPartition]:
        return iter((self.partition,))

    def __len__(self) -> int:
        return 1

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.partition!r})"


def _checked(data: Data, num_classes: int | None) -> Data:
    """``data`` after every input check (edges, finite features, labels below ``num_classes``, masks
    selecting labeled vertices), without the edge attributes no Dorylus layer reads (a shallow copy, after a
    warning saying so)."""
    check_graph(data, num_classes)
    if not ignored_attributes(data):
        return data
    warn_ignored_attributes(data, stacklevel=4)
    data = copy.copy(data)  # shares the tensors; the caller's Data keeps its attributes
    for name in IGNORED_EDGE_FIELDS:
        if getattr(data, name, None) is not None:
            delattr(data, name)
    return data


class DorylusDataModule(LightningDataModule):
    """Partitions a graph across graph servers and gives every process its own partition.

    Args:
        data: The graph: a PyG ``Data``; a one-graph ``InMemoryDataset`` (e.g. ``load_planetoid(...)``); a
            path to a graph ``.safetensors`` file (``cache.save_graph``); or a path to an existing partition
            directory (``meta.json`` + ``part_<k>.safetensors``), whose ``partitioner``, ``interval_size``
            and ``seed`` then replace the arguments below; or a :class:`ChunkedGraph` (``.npy`` chunk files
            read memory-mapped, for graphs no machine holds): ``prepare_data`` then partitions it by
            streaming (``partitioner="fennel"``, ``"hash"`` or ``"range"``), each machine building only its
            own graph servers' partitions, with memory per vertex plus one chunk (``data/streaming.py``).
        num_parts: Number of partitions; ``None`` means ``trainer.world_size`` (one per process).
        partitioner: ``"metis"`` (default; falls back to ``"bfs"`` with a warning without pymetis),
            ``"bfs"``, ``"contiguous"`` or ``"random"``; for a ``ChunkedGraph`` one of ``"fennel"``,
            ``"hash"``, ``"range"``.
        interval_size: Vertices per interval, the unit of work sent to a tensor-op executor (``>= 1``).
        cache_dir: Root of the partition cache; ``None``: ``$XDG_CACHE_HOME/lightning_dorylus/partitions``.
        seed: Seed of the partitioner (METIS, random).
        transform: Applied once to the whole graph before it is partitioned, e.g. PyG's
            ``NormalizeFeatures()`` (row-normalised features, as PyG's Planetoid examples). The partitions
            (and their cache key) hold the transformed graph, so no epoch recomputes it. Not allowed with a
            partition directory, whose partitions are already built.
        num_classes: Number of classes the model predicts; every label must be below it (checked here).
            ``None``: ``max(y) + 1``.
        cache_max_age_days: After partitioning (or finding the partitioning in the cache), delete the other
            partitionings of ``cache_dir`` unused for longer than this (``None``: keep them).
        cache_max_bytes: ... and the least recently used others beyond this many bytes in all (``None``: no
            size bound). Never the one in use, nor one used in the last hour (``data/prune.py``).

    The graph is checked here, in every process, before any graph server starts: edges in range, finite
    features, ``edge_weight`` (one finite weight per edge; read by ``GCNConv``), labels ``>= 0`` (``-1``:
    unlabeled) and ``< num_classes`` or multi-label targets ``(N, C)`` in ``[0, 1]``, masks (bool, or
    vertex indices as ``index_to_mask`` takes them) selecting labeled vertices only. Errors name the
    vertex and the fix.
    """

    def __init__(
        self,
        data: Data | InMemoryDataset | str | Path | ChunkedGraph,
        num_parts: int | None = None,
        partitioner: str = "metis",
        interval_size: int = DEFAULT_INTERVAL_SIZE,
        cache_dir: str | Path | None = None,
        seed: int = 0,
        transform: Callable[[Data], Data] | None = None,
        num_classes: int | None = None,
        cache_max_age_days: float | None = 30.0,
        cache_max_bytes: int | None = None,
    ) -> None:
        super().__init__()
        if transform is not None and not callable(transform):
            raise TypeError(
                f"transform must be a callable Data -> Data (e.g. NormalizeFeatures()), got {transform!r}"
            )
        if isinstance(data, ChunkedGraph):
            if partitioner not in STREAM_PARTITIONERS:
                raise ValueError(
                    f"partitioner={partitioner!r} cannot partition a ChunkedGraph: METIS and BFS need the "
                    f"whole graph in one process. Pass partitioner= one of {list(STREAM_PARTITIONERS)} "
                    "(fennel: the lowest edge cut), or load a graph that fits into a torch_geometric Data"
                )
        else:
            check_partitioner(partitioner)
        interval_size = check_interval_size(interval_size)
        if num_parts is not None and (not is_integer(num_parts) or num_parts < 1):
            raise ValueError(
                f"num_parts ({num_parts!r}) must be None (= trainer.world_size) or an integer >= 1"
            )
        self.num_parts = None if num_parts is None else int(num_parts)
        self.partitioner = partitioner
        self.interval_size = interval_size
        self.seed = int(seed)
        self._num_classes = check_num_classes(num_classes)
        self.cache_dir = check_cache_dir(cache_dir if cache_dir is not None else default_cache_dir())
        bounds = (("cache_max_age_days", cache_max_age_days), ("cache_max_bytes", cache_max_bytes))
        for name, bound in bounds:
            numeric = isinstance(bound, int | float) and not isinstance(bound, bool)
            if bound is not None and (not numeric or bound <= 0):
                raise ValueError(f"{name}={bound!r}: expected None (no bound) or a number > 0")
        self._cache_max_age_s = None if cache_max_age_days is None else float(cache_max_age_days) * 86400
        self._cache_max_bytes = cache_max_bytes
        self.data: Data | None = None
        self.partition_dir: Path | None = None  # fixed when `data` is a partition directory
        self.chunked: ChunkedGraph | None = None  # set when `data` is a ChunkedGraph (streamed preparation)
        self.partition: GraphPartition | None = None
        self._digest: str | None = None
        self._fingerprint: dict[str, str] | None = None  # per-field digests, compared across processes

        if isinstance(data, ChunkedGraph):
            if transform is not None:
                raise ValueError(
                    f"transform={transform!r} cannot apply to a ChunkedGraph (its files are read chunk by "
                    "chunk, never as one Data): transform the arrays before saving them"
                )
            self.chunked = data
        elif isinstance(data, (str, Path)):
            path = Path(data)
            if path.is_dir():
                self._use_partition_dir(path)
            elif path.is_file() and path.suffix == ".safetensors":
                self.data = load_graph(path)
            else:
                raise FileNotFoundError(
                    f"data={str(data)!r} is neither a partition directory (meta.json + part_<k>.safetensors) "
                    "nor a graph .safetensors file"
                )
        elif isinstance(data, InMemoryDataset):
            if len(data) != 1:
                raise ValueError(
                    f"data is a dataset of {len(data)} graphs; Dorylus trains on exactly one graph"
                )
            self.data = data[0]
        elif isinstance(data, Data):
            self.data = data
        else:
            raise TypeError(
                "data must be a torch_geometric Data, a one-graph InMemoryDataset, a ChunkedGraph or a path, "
                f"got {type(data).__name__}"
            )
        if transform is not None:
            if self.data is None:
                raise ValueError(
                    f"transform={transform!r} cannot apply to the partition directory {str(data)!r}: its "
                    "partitions are already built; transform the graph before partitioning it"
                )
            self.data = transform(self.data.clone())
        self.transform = transform
        if self.data is not None:
            self.data = _checked(self.data, self._num_classes)

    def _use_partition_dir(self, path: Path) -> None:
        meta = read_meta(path)
        if self.num_parts is not None and self.num_parts != meta["num_parts"]:
            raise ValueError(
                f"num_parts ({self.num_parts}) does not match the {meta['num_parts']} partitions in {path}"
            )
        if self._num_classes is not None and self._num_classes < meta["num_classes"]:
            raise ValueError(
                f"num_classes ({self._num_classes}) is below the {meta['num_classes']} classes (max(y) + 1) "
                f"of the partitions in {path}: pass num_classes >= {meta['num_classes']}"
            )
        self.partition_dir = path
        self.num_parts = meta["num_parts"]
        self.partitioner, self.interval_size, self.seed = (
            meta["partitioner"],
            meta["interval_size"],
            meta["seed"],
        )

    @property
    def num_features(self) -> int:
        """Feature width of the graph."""
        if self.data is not None:
            return int(self.data.x.size(1))
        if self.chunked is not None:
            return self.chunked.num_features
        assert self.partition_dir is not None
        return int(read_meta(self.partition_dir)["num_features"])

    @property
    def num_classes(self) -> int:
        """Number of classes: the ``num_classes`` argument, else ``max(y) + 1``; for multi-label targets
        ``y`` of shape ``(N, C)``, ``C`` (the model's output width either way)."""
        if self._num_classes is not None:
            return self._num_classes
        if self.data is not None:
            if self.data.y is None:
                raise ValueError(
                    "data.y is None: num_classes needs integer class labels (y), one per vertex"
                )
            if is_multi_label(self.data.y):
                return int(self.data.y.size(1))
            return int(self.data.y.max()) + 1
        if self.chunked is not None:
            return int(self.chunked.labels().max()) + 1
        assert self.partition_dir is not None
        return int(read_meta(self.partition_dir)["num_classes"])

    def resolved_num_parts(self) -> int:
        """``num_parts``, or ``trainer.world_size`` when it was left as ``None``."""
        if self.num_parts is not None:
            return self.num_parts
        if self.trainer is None:
            raise RuntimeError("num_parts is None and no Trainer is attached: pass num_parts explicitly")
        return self.trainer.world_size

    def resolved_partition_dir(self) -> Path:
        """The cache directory that holds (or will hold) this graph's partitioning."""
        if self.partition_dir is not None:
            return self.partition_dir
        if self.chunked is not None:
            return self.cache_dir / streamed_name(
                self.graph_digest(), self.partitioner, self.resolved_num_parts(), self.interval_size,
                self.seed, self._node_parts(),
            )
        name = cache_name(
            self.graph_digest(), self.partitioner, self.resolved_num_parts(), self.interval_size, self.seed
        )
        return self.cache_dir / name

    def graph_digest(self) -> str:
        """The input graph's :func:`graph_hash` (the cache key; computed once)."""
        if self._digest is None:
            if self.chunked is not None:
                self._digest = self.chunked.digest()
            elif self.data is None:
                assert self.partition_dir is not None
                self._digest = str(read_meta(self.partition_dir)["graph_hash"])
            else:
                self._fingerprint = graph_fingerprint(self.data)
                self._digest = graph_hash(self.data, self._fingerprint)
        return self._digest

    @override
    def prepare_data(self) -> None:
        """Partitions the graph into the cache unless an intact copy is there (every file checked against
        its checksum; a damaged one rebuilt, with a warning). Lightning: local rank 0 of each node only."""
        if self.partition_dir is not None:
            return
        num_parts = self.resolved_num_parts()
        if self.trainer is not None and num_parts != self.trainer.world_size:
            return  # setup raises on every process; raising here would leave the others at the barrier
        if self.chunked is not None:
            prepare_streamed(
                self.chunked, num_parts, self.partitioner, self.interval_size, self.seed, self.cache_dir,
                parts=self._node_parts(), digest=self.graph_digest(),
            )
            return
        assert self.data is not None
        partition_to_cache(
            self.data,
            num_parts,
            self.partitioner,
            self.interval_size,
            self.seed,
            self.cache_dir,
            digest=self.graph_digest(),
            max_age_s=self._cache_max_age_s,
            max_bytes=self._cache_max_bytes,
        )

    def _node_parts(self) -> list[int]:
        """The partitions this machine's graph servers load (all of them without a Trainer)."""
        num_parts = self.resolved_num_parts()
        if self.trainer is None:
            return list(range(num_parts))
        return node_parts(self.trainer.node_rank, self.trainer.num_devices, num_parts)

    @override
    def setup(self, stage: str) -> None:
        """Loads partition ``trainer.global_rank`` (partition 0 without a Trainer, after partitioning), once
        every process has the same graph (compared by digest across processes)."""
        num_parts = self.resolved_num_parts()
        rank, world_size = (
            (0, 1) if self.trainer is None else (self.trainer.global_rank, self.trainer.world_size)
        )
        check_world_size(num_parts, world_size)
        if self.trainer is None:
            self.prepare_data()
        directory = self.resolved_partition_dir()
        if world_size > 1:
            check_same_graph(self.trainer.strategy, self.graph_digest(), self._fingerprint)
        if not is_complete(directory):
            raise FileNotFoundError(
                f"partition cache {directory} is missing or incomplete on rank {rank}: prepare_data() must "
                "run first, and cache_dir must be shared by the processes of a node"
            )
        partition = load_partition(directory, rank)  # checks the file against the manifest's checksum
        if self.trainer is not None:  # move once, so Lightning's per-step transfer is a no-op
            partition = partition.to(self.trainer.strategy.root_device)
        self.partition = partition

    def _loader(self) -> PartitionLoader:
        if self.partition is None:
            raise RuntimeError("DorylusDataModule.setup() has not run yet: no partition is loaded")
        return PartitionLoader(self.partition)

    @override
    def train_dataloader(self) -> PartitionLoader:
        return self._loader()

    @override
    def val_dataloader(self) -> PartitionLoader:
        return self._loader()

    @override
    def test_dataloader(self) -> PartitionLoader:
        return self._loader()

    @override
    def predict_dataloader(self) -> PartitionLoader:
        return self._loader()

    @override
    def __str__(self) -> str:  # LightningDataModule.__str__ would iterate the loaders
        return repr(self)

    def __repr__(self) -> str:
        source = next(s for s in (self.data, self.chunked, str(self.partition_dir)) if s is not None)
        loaded = f", partition={self.partition!r}" if self.partition is not None else ""
        return (
            f"{type(self).__name__}(data={source}, num_parts={self.num_parts}, "
            f"partitioner={self.partitioner!r}, interval_size={self.interval_size}, seed={self.seed}, "
            f"cache_dir='{self.cache_dir}'{loaded})"
        )
