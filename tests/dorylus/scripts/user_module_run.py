"""Worker script: a USER LightningModule (``docs/examples/own_gcn.py``'s ``UserGCN``, not a NodeClassifier)
trained with ``DorylusStrategy`` on N graph servers; records the logged loss, the weights and the predictions.

Launched by ``tests/dorylus/test_user_module.py`` (all ranks at once, ``tests.process.run_ranks``), which
trains the same models in its own process under ``strategy="auto"`` with :func:`build_model` and :func:`fit`.

Usage: python user_module_run.py OUT_DIR --servers N --cases CASES_JSON
``CASES_JSON``: ``{name: {"model": "gcn"|"gin"|"torch_dropout"|"batchnorm", "optimizer": "sgd"|"adam",
"dropout": p, "executor": "inline"|"local", "loss_reduction": null|"mean"|"sum", "staleness": null|0,
"first_part": k}}``; each case trains in turn into ``OUT_DIR/<name>``: ``result.json`` (rank 0: per-epoch
train_loss), ``weights_rank{r}.safetensors`` and ``predictions_rank{r}.safetensors`` (``trainer.predict``
on rank r).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from safetensors.torch import save_file
from torch import Tensor, nn

from lightning_dorylus import DorylusStrategy
from lightning_dorylus.data import GraphPartition, build_partitions, partition_graph
from lightning_dorylus.data.build import graph_tensors
from tests.dorylus.scripts.exact_run import INTERVAL_SIZE, NUM_CLASSES, NUM_FEATURES, loader, make_graph
from tests.process import REPO

sys.path.insert(0, str(REPO / "docs" / "examples"))  # the user's own modules, as a user's script has them
from gin_conv import GINConv
from own_gcn import UserGCN

EPOCHS = 3


class UserGIN(UserGCN):
    """The same module with the user's own layer (``GINConv`` on the user op ``gin.mlp``)."""

    def __init__(self, in_channels: int, hidden_channels: int, num_classes: int, **kwargs: Any) -> None:
        super().__init__(in_channels, hidden_channels, num_classes, **kwargs)
        self.conv1 = GINConv(in_channels, hidden_channels, hidden_channels)
        self.conv2 = GINConv(hidden_channels, hidden_channels, num_classes)

    def forward(self, batch: GraphPartition) -> Tensor:
        graph = self.graphs.context(batch)
        h = F.relu(self.conv1(self.dropout(batch.x, batch, site=0), graph))
        return self.conv2(self.dropout(h, batch, site=1), graph)


class TorchDropoutGCN(UserGCN):
    """PyG-style ``F.dropout``: each server draws from its own torch generator (the strategy warns)."""

    def dropout(self, h: Tensor, batch: GraphPartition, site: int) -> Tensor:
        return F.dropout(h, self.hparams.dropout, self.training)


class BatchNormGCN(UserGCN):
    """``torch.nn.BatchNorm1d`` over the hidden vertices: its batch statistics must be the whole graph's."""

    def __init__(self, in_channels: int, hidden_channels: int, num_classes: int, **kwargs: Any) -> None:
        super().__init__(in_channels, hidden_channels, num_classes, **kwargs)
        self.norm = nn.BatchNorm1d(hidden_channels, momentum=0.3)

    def forward(self, batch: GraphPartition) -> Tensor:
        graph = self.graphs.context(batch)
        h = self.norm(self.conv1(self.dropout(batch.x, batch, site=0), graph))
        return self.conv2(self.dropout(h, batch, site=1), graph)


MODELS = {"gcn": UserGCN, "gin": UserGIN, "torch_dropout": TorchDropoutGCN, "batchnorm": BatchNormGCN}


def build_model(case: dict[str, Any]) -> LightningModule:
    seed_everything(0, verbose=False)
    model = MODELS[case["model"]](NUM_FEATURES, 16, NUM_CLASSES, dropout=case["dropout"], lr=0.1,
                                  optimizer=case["optimizer"])
    return model.double()


class LossRecorder(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(trainer.callback_metrics["train_loss"]))


def fit(model: LightningModule, partitions: list[GraphPartition], strategy: Any, devices: int
        ) -> tuple[Trainer, list[float], Tensor]:
    """Fits ``EPOCHS`` epochs on ``partitions[rank]``, then predicts; the trainer, losses, predictions."""
    recorder = LossRecorder()
    trainer = Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_epochs=EPOCHS, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      num_sanity_val_steps=0, limit_val_batches=0, callbacks=[recorder])
    part = partitions[trainer.global_rank]
    trainer.fit(model, train_dataloaders=loader(part))
    [predictions] = trainer.predict(model, loader(part))
    return trainer, recorder.losses, predictions


def make_partitions(case: dict[str, Any], servers: int) -> list[GraphPartition]:
    """METIS's (balanced) partitions, or with ``"first_part": k`` vertices ``0..k-1`` on server 0 and the rest
    on server 1 (2 servers): partitions of unequal size."""
    if "first_part" not in case:
        return partition_graph(make_graph(), servers, partitioner="metis", interval_size=INTERVAL_SIZE)
    graph = graph_tensors(make_graph())
    assignment = (torch.arange(graph.num_nodes) >= case["first_part"]).long()
    return build_partitions(graph, assignment, 2, INTERVAL_SIZE)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--servers", type=int, default=2)
    parser.add_argument("--cases", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    for name, case in json.loads(args.cases.read_text()).items():
        partitions = make_partitions(case, args.servers)
        print(f"user_module_run: case {name}", flush=True)
        out = args.out / name
        out.mkdir(parents=True, exist_ok=True)
        options = {"num_workers": 1} if case["executor"] == "local" else {}
        strategy = DorylusStrategy(executor=case["executor"], executor_options=options,
                                   loss_reduction=case.get("loss_reduction"), staleness=case.get("staleness"),
                                   timeout=datetime.timedelta(seconds=180))
        model = build_model(case)
        trainer, losses, predictions = fit(model, partitions, strategy, devices=args.servers)
        rank = trainer.global_rank
        save_file({k: v.detach().contiguous() for k, v in model.state_dict().items()},
                  str(out / f"weights_rank{rank}.safetensors"))
        save_file({"predictions": predictions.contiguous()}, str(out / f"predictions_rank{rank}.safetensors"))
        if rank == 0:
            (out / "result.json").write_text(json.dumps({"losses": losses, "n_local": partitions[0].n_local}))


if __name__ == "__main__":
    main()
