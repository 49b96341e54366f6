"""Worker script: train a float64 GCN with ``DorylusStrategy`` on N graph servers on a PyG user's data
variants (weighted edges, duplicate edges, multi-label targets with index-tensor masks) and record losses
and weights.

Launched by ``tests/dorylus/test_pyg_data.py``, one process per graph server started together
(``tests.process.run_ranks``). Every case trains in turn in this one launch, into ``OUT_DIR/<case>``: rank 0
writes ``result.json`` (the per-epoch global train loss), every rank ``weights_rank{r}.safetensors``. The
test builds the same graphs and models with :func:`make_case_graph` and :func:`make_case_model` and trains
them with PyG's own layers and under ``strategy="auto"`` as the references.

Usage: python pyg_data_run.py OUT_DIR --servers N [--epochs 5] [--cases weighted,duplicates,multilabel]
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

import torch
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from safetensors.torch import save_file
from torch_geometric.data import Data

from lightning_dorylus import GCN, DorylusStrategy
from lightning_dorylus.data import GraphPartition, partition_graph
from tests.dorylus.scripts.exact_run import INTERVAL_SIZE, NUM_CLASSES, NUM_FEATURES, loader, make_graph

CASES = ("weighted", "duplicates", "weighted-duplicates", "multilabel")
NUM_LABELS = 5  # multi-label targets per vertex


def make_case_graph(case: str) -> Data:
    """``exact_run.make_graph()`` changed as a PyG user's data would be.

    * ``weighted``: ``edge_weight`` in ``[0.1, 2.1)`` per edge (not symmetric).
    * ``duplicates``: a fifth of the edges twice more, one of them three more times (unweighted).
    * ``weighted-duplicates``: both (each copy with its own weight).
    * ``multilabel``: ``y`` of shape ``(N, 5)``, 0/1 from linear functions of the features and neighbours'
      labels; ``train_mask``/``val_mask`` as LongTensors of vertex indices.
    """
    data = make_graph()
    gen = torch.Generator().manual_seed(1)
    if case in ("duplicates", "weighted-duplicates"):
        ei = data.edge_index
        picked = torch.randperm(ei.size(1), generator=gen)[: ei.size(1) // 5]
        data.edge_index = torch.cat([ei, ei[:, picked], ei[:, picked[:1]].repeat(1, 3)], dim=1)
    if case in ("weighted", "weighted-duplicates"):
        data.edge_weight = 0.1 + 2.0 * torch.rand(data.edge_index.size(1), generator=gen, dtype=torch.float64)
    if case == "multilabel":
        directions = torch.randn(NUM_FEATURES, NUM_LABELS, generator=gen, dtype=torch.float64)
        scores = data.x @ directions + 0.5 * torch.randn(data.num_nodes, NUM_LABELS, generator=gen,
                                                         dtype=torch.float64)
        data.y = (scores > 0).long()  # ogbn-proteins style: int64 0/1 of shape (N, C)
        data.train_mask = data.train_mask.nonzero().view(-1)
        data.val_mask = data.val_mask.nonzero().view(-1)
    elif case not in CASES:
        raise ValueError(f"case {case!r}: expected one of {CASES}")
    return data


def make_case_model(case: str, seed: int = 0) -> LightningModule:
    """The float64 two-layer GCN under test (no dropout, so PyG's layers can be the reference)."""
    seed_everything(seed, verbose=False)
    out = NUM_LABELS if case == "multilabel" else NUM_CLASSES
    return GCN(NUM_FEATURES, 16, out, dropout=0.0, lr=0.05, weight_decay=5e-4).double()


class LossRecorder(Callback):
    """Keeps the global train loss of every epoch."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(trainer.callback_metrics["train_loss"]))


def fit(model: LightningModule, partitions: list[GraphPartition], epochs: int, strategy, devices: int):
    """Fits ``model`` on ``partitions[trainer.global_rank]`` (no validation); returns trainer, recorder."""
    recorder = LossRecorder()
    trainer = Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_epochs=epochs, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      limit_val_batches=0, callbacks=[recorder])
    trainer.fit(model, train_dataloaders=loader(partitions[trainer.global_rank]))
    return trainer, recorder


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--servers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--cases", default=",".join(CASES))
    args = parser.parse_args()
    torch.set_num_threads(1)
    for case in args.cases.split(","):
        print(f"pyg_data_run: case {case}", flush=True)
        out = args.out / case
        out.mkdir(parents=True, exist_ok=True)
        partitions = partition_graph(make_case_graph(case), args.servers, partitioner="metis",
                                     interval_size=INTERVAL_SIZE)
        strategy = DorylusStrategy(executor="inline", timeout=datetime.timedelta(seconds=180))
        model = make_case_model(case)
        trainer, recorder = fit(model, partitions, args.epochs, strategy, args.servers)
        rank = trainer.global_rank
        weights = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
        save_file(weights, str(out / f"weights_rank{rank}.safetensors"))
        if rank == 0:
            result = {"losses": recorder.losses, "ghosts": [p.n_ghost for p in partitions]}
            (out / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
