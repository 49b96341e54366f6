"""GCN and GAT LightningModules on the whole graph (``strategy="auto"``, one partition, inline executor)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule, Trainer

from lightning_dorylus import GAT, GCN
from lightning_dorylus.data import partition_graph
from tests.dorylus.scripts.exact_run import INTERVAL_SIZE, NUM_CLASSES, NUM_FEATURES, loader, make_graph


def fit(model: LightningModule, epochs: int, tmp_path: Path) -> Trainer:
    [part] = partition_graph(make_graph(), 1, interval_size=INTERVAL_SIZE)
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(model, train_dataloaders=loader(part), val_dataloaders=loader(part))
    return trainer


@pytest.mark.parametrize("model_cls", [GCN, GAT])
def test_model_learns_on_the_whole_graph(model_cls: type, tmp_path: Path) -> None:
    torch.manual_seed(0)
    kwargs = {"dropout": 0.1, "lr": 0.02}
    if model_cls is GAT:
        kwargs.update(heads=2)
    model = model_cls(NUM_FEATURES, 8, NUM_CLASSES, **kwargs).double()
    first = fit(model, 1, tmp_path).callback_metrics["train_loss"].item()
    trainer = fit(model, 40, tmp_path)
    assert trainer.callback_metrics["train_loss"].item() < 0.7 * first
    assert trainer.callback_metrics["val_acc"].item() > 1.5 / NUM_CLASSES  # well above chance


def test_loss_is_global_mean_and_accuracy_global_ratio(tmp_path: Path) -> None:
    """With one partition the logged loss is the mean CE over train vertices and val_acc their accuracy."""
    data = make_graph()
    [part] = partition_graph(data, 1, interval_size=INTERVAL_SIZE)
    torch.manual_seed(0)
    model = GCN(NUM_FEATURES, 8, NUM_CLASSES, dropout=0.0).double()
    with torch.no_grad():
        logits = model(model.graph(part))
    expected_loss = F.cross_entropy(logits[part.train_mask], part.y[part.train_mask])
    expected_acc = (logits.argmax(-1)[part.val_mask] == part.y[part.val_mask]).double().mean()
    assert part.num_train_global == int(data.train_mask.sum())

    trainer = Trainer(
        accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, default_root_dir=tmp_path
    )
    [metrics] = trainer.validate(model, loader(part), verbose=False)
    assert metrics["val_acc"] == pytest.approx(expected_acc.item(), abs=1e-6)
    trainer = fit(model, 1, tmp_path)  # the loss logged by the one step is taken before the optimizer step
    torch.testing.assert_close(trainer.callback_metrics["train_loss"].double(), expected_loss)


def test_gcn_layers_and_activations() -> None:
    model = GCN(5, 4, 3, num_layers=3)
    assert [c.activation for c in model.convs] == ["relu", "relu", "none"]
    assert [(c.in_channels, c.out_channels) for c in model.convs] == [(5, 4), (4, 4), (4, 3)]
    with pytest.raises(ValueError, match=r"num_layers=0 must be >= 1"):
        GCN(5, 4, 3, num_layers=0)


def test_gat_shapes_follow_pyg_cora_example() -> None:
    model = GAT(1433, 8, 7, heads=8, out_heads=1)
    assert tuple(model.conv1.weight.shape) == (1433, 64)
    assert tuple(model.conv2.weight.shape) == (64, 7)
    assert model.conv1.concat and not model.conv2.concat
    assert model.conv1.dropout == model.conv2.dropout == 0.6
