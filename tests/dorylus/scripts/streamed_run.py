"""Worker script: train ``exact_run``'s GCN/GAT on N graph servers from a :class:`ChunkedGraph` prepared by
streaming (``DorylusDataModule(ChunkedGraph, partitioner=...)``), recording losses and weights.

Launched by ``tests/dorylus/test_streaming.py`` (one process per graph server, ``tests.process.run_ranks``),
after the test wrote ``exact_run.make_graph()`` as chunk files with :func:`write_chunks`. Rank 0 writes
``result.json``; every rank writes ``weights_rank{r}.safetensors``.

Usage: python streamed_run.py OUT_DIR GRAPH_DIR --servers N [--model gcn] [--partitioner fennel] [--epochs 5]
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

import numpy as np
import torch
from lightning.pytorch import Trainer
from safetensors.torch import save_file
from torch_geometric.data import Data

from lightning_dorylus import DorylusStrategy
from lightning_dorylus.data import DorylusDataModule
from lightning_dorylus.data.chunked import ChunkedGraph
from tests.dorylus.scripts.exact_run import INTERVAL_SIZE, Recorder, make_model


def write_chunks(data: Data, directory: Path, num_chunks: int = 3) -> ChunkedGraph:
    """``data`` as chunk files (int32 and int64 edge chunks, a bool mask and an index split)."""
    directory.mkdir(parents=True, exist_ok=True)
    edge_index = data.edge_index.numpy()
    names = []
    for i, part in enumerate(np.array_split(np.arange(edge_index.shape[1]), num_chunks)):
        chunk = edge_index[:, part]
        names.append(f"edges_{i}.npy")
        np.save(directory / names[-1], chunk.astype(np.int32 if i % 2 else np.int64))
    np.save(directory / "x.npy", data.x.numpy())
    np.save(directory / "y.npy", data.y.numpy())
    np.save(directory / "train.npy", data.train_mask.numpy())
    np.save(directory / "val.npy", np.flatnonzero(data.val_mask.numpy()))
    np.save(directory / "test.npy", data.test_mask.numpy())
    return chunked(directory, num_chunks)


def chunked(directory: Path, num_chunks: int = 3) -> ChunkedGraph:
    return ChunkedGraph(
        edges=[f"edges_{i}.npy" for i in range(num_chunks)], x="x.npy", y="y.npy", train="train.npy",
        val="val.npy", test="test.npy", root=directory,
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("graph", type=Path)
    parser.add_argument("--servers", type=int, default=2)
    parser.add_argument("--model", default="gcn")
    parser.add_argument("--partitioner", default="fennel")
    parser.add_argument("--epochs", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    datamodule = DorylusDataModule(
        chunked(args.graph), partitioner=args.partitioner, interval_size=INTERVAL_SIZE,
        cache_dir=args.out / "cache",
    )
    strategy = DorylusStrategy(executor="inline", timeout=datetime.timedelta(seconds=180))
    model = make_model(args.model)
    recorder = Recorder()
    trainer = Trainer(
        accelerator="cpu", devices=args.servers, strategy=strategy, max_epochs=args.epochs, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, callbacks=[recorder],
    )
    trainer.fit(model, datamodule=datamodule)
    rank = trainer.global_rank
    weights = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    save_file(weights, str(args.out / f"weights_rank{rank}.safetensors"))
    ghosts = datamodule.partition.n_ghost if datamodule.partition is not None else -1
    (args.out / f"ghosts_rank{rank}.json").write_text(json.dumps(ghosts))
    if rank == 0:
        result = {"losses": recorder.losses, "val_acc": recorder.val_acc}
        (args.out / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
