"""Named errors before any weight moves (issue 32): a PyG layer outside a Dorylus layer is refused at setup
(it would meet ghost ids in ``edge_index``: a bare ``IndexError``), and a model with fewer outputs than the
graph has classes fails with ``LabelRangeError`` (not torch's "Target out of bounds"): before the first
epoch where the last layer's width and the partition are at hand, else at the loss of the first step. One
graph server in this process; ``test_model_checks_two_servers`` below runs all three on two."""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import Callback, Trainer
from torch import Tensor, nn
from torch_geometric.nn import GCNConv as PygGCNConv

from lightning_dorylus import DorylusStrategy
from lightning_dorylus.data import GraphPartition, PartitionLoader, partition_graph
from lightning_dorylus.model_checks import (
    LabelRangeCheck,
    LabelRangeError,
    check_foreign_layers,
    num_labels,
    output_width,
)
from lightning_dorylus.models import GAT
from lightning_dorylus.nn import DorylusLayer, GATConv
from tests.dorylus.scripts.exact_run import INTERVAL_SIZE, NUM_CLASSES, NUM_FEATURES, loader, make_graph
from tests.dorylus.scripts.user_module_run import UserGCN
from tests.process import REPO, run_ranks

FOREIGN = (r"PygGCN\.conv2 \(torch_geometric\.nn\.conv\.gcn_conv\.GCNConv\) is a PyG message-passing layer "
           r"outside a Dorylus layer: .*ghost vertices.*Use a Dorylus layer")
TOO_FEW = (rf"cross_entropy got {NUM_CLASSES - 1} class scores per vertex, but the graph's labels \(batch\.y "
           rf"on every graph server\) go up to {NUM_CLASSES - 1}: the model needs {NUM_CLASSES} outputs")

EARLY = (rf"UserGCN\.conv2 \(the model's last layer\) got {NUM_CLASSES - 1} class scores per vertex, but the "
         rf"graph's labels \(batch\.y on every graph server\) go up to {NUM_CLASSES - 1}: the model needs "
         rf"{NUM_CLASSES} outputs")


class PygGCN(UserGCN):
    """A Dorylus GCNConv, then PyG's GCNConv on ``batch.edge_index`` (the mix the issue met)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.conv2 = PygGCNConv(self.hparams.hidden_channels, self.hparams.num_classes)

    def forward(self, batch: GraphPartition) -> Tensor:
        return self.conv2(self.conv1(batch.x, self.graphs.context(batch)), batch.edge_index)


class OwnGA(DorylusLayer):
    """A Dorylus layer whose GA is PyG code on ``self.scatter``'s rows: allowed."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = PygGCNConv(2, 2)


@pytest.fixture
def one_server(tmp_path: Path) -> Iterator[tuple[Trainer, GraphPartition]]:
    [part] = partition_graph(make_graph(), 1, interval_size=INTERVAL_SIZE)
    trainer = Trainer(accelerator="cpu", devices=1, strategy=DorylusStrategy(executor="inline"), max_epochs=1,
                      logger=False, enable_progress_bar=False, enable_model_summary=False,
                      enable_checkpointing=False, default_root_dir=tmp_path, num_sanity_val_steps=0,
                      limit_val_batches=0)
    try:
        yield trainer, part
    finally:  # a 1-process group was created in this (pytest) process
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def test_pyg_layer_outside_a_dorylus_layer_is_refused_at_setup(one_server) -> None:
    trainer, part = one_server
    model = PygGCN(NUM_FEATURES, 8, NUM_CLASSES).double()
    with pytest.raises(TypeError, match=FOREIGN):
        trainer.fit(model, loader(part))
    assert trainer.global_step == 0


def test_pyg_code_inside_a_dorylus_layer_is_the_users_own_ga() -> None:
    check_foreign_layers(torch.nn.Sequential(OwnGA()))
    with pytest.raises(TypeError, match=r"Sequential\.0\.1 \(torch_geometric"):
        check_foreign_layers(torch.nn.Sequential(torch.nn.Sequential(torch.nn.ReLU(), PygGCNConv(2, 2))))


def test_too_few_outputs_for_the_labels_fail_before_the_first_update(one_server) -> None:
    trainer, part = one_server
    model = UserGCN(NUM_FEATURES, 8, NUM_CLASSES - 1, optimizer="sgd").double()  # make_graph: float64
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(LabelRangeError, match=TOO_FEW):
        trainer.fit(model, loader(part))
    assert trainer.global_step == 0
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key


class EpochStarts(Callback):
    def __init__(self) -> None:
        self.started = 0

    def on_train_epoch_start(self, trainer: Trainer, pl_module: object) -> None:
        self.started += 1


def test_too_few_outputs_fail_before_the_first_epoch(one_server) -> None:
    """With the partition at hand (a ``PartitionLoader``, as ``DorylusDataModule`` gives) and a last layer
    that says its width, no epoch starts."""
    trainer, part = one_server
    starts = EpochStarts()
    trainer.callbacks.append(starts)
    model = UserGCN(NUM_FEATURES, 8, NUM_CLASSES - 1).double()
    with pytest.raises(LabelRangeError, match=EARLY):
        trainer.fit(model, PartitionLoader(part))
    assert starts.started == 0 and trainer.global_step == 0


def test_enough_outputs_train_with_the_early_check(one_server) -> None:
    trainer, part = one_server
    trainer.fit(UserGCN(NUM_FEATURES, 8, NUM_CLASSES).double(), PartitionLoader(part))
    assert trainer.global_step == 1


class NoWidth(DorylusLayer):
    """A user's Dorylus layer that does not declare ``output_width`` (its inner PyG layer is its own GA)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = PygGCNConv(2, 3)


def test_output_width_reads_the_last_layer_or_nothing() -> None:
    assert output_width(UserGCN(NUM_FEATURES, 8, 3)) == ("UserGCN.conv2", 3)
    assert output_width(GAT(NUM_FEATURES, 8, 5, heads=4)) == ("GAT.conv2", 5)  # mean over its heads
    assert output_width(nn.Sequential(GATConv(4, 3, heads=2), nn.ELU())) == ("Sequential.0", 6)  # concat
    assert output_width(nn.Sequential(nn.Sequential(nn.Linear(4, 9)), nn.ReLU())) == ("Sequential.0.0", 9)
    assert output_width(nn.Sequential(nn.Linear(4, 5), nn.LayerNorm(5))) is None  # a LayerNorm last
    assert output_width(nn.Sequential(nn.Linear(4, 5), NoWidth())) is None  # not its inner PyG layer's
    assert output_width(nn.ReLU()) is None


def test_enough_outputs_pass_and_unlabelled_vertices_do_not_count() -> None:
    assert num_labels(torch.tensor([-1, 0, 2, -1])) == 3
    assert num_labels(torch.tensor([-1, -1])) == 0 and num_labels(None) == 0
    assert num_labels(torch.ones(3)) == 0  # regression targets: nothing to check


@pytest.mark.multiprocess
def test_model_checks_two_servers(tmp_path: Path) -> None:
    """Both errors on 2 graph servers: every rank raises the named error (none waits in a collective)."""
    script = REPO / "tests" / "dorylus" / "scripts" / "model_checks_run.py"
    for case, expected, epochs in (("pyg", FOREIGN, 0), ("too_few", TOO_FEW, 1), ("too_few_early", EARLY, 0)):
        folder = tmp_path / case
        folder.mkdir()
        done = run_ranks([sys.executable, str(script), case], 2, timeout=240, cwd=folder)
        records = sorted(folder.glob("error_rank*.json"))
        assert [r.name for r in records] == ["error_rank0.json", "error_rank1.json"], done.stdout[-3000:]
        for record in records:
            error = json.loads(record.read_text())
            assert re.search(expected, f"{error['type']}: {error['message']}"), error
            assert error["epochs_started"] == epochs, error


def test_loss_check_reads_input_by_keyword() -> None:
    with LabelRangeCheck(3), pytest.raises(LabelRangeError, match=r"cross_entropy got 2 class scores"):
        F.cross_entropy(input=torch.zeros(4, 2), target=torch.zeros(4, dtype=torch.long))
    with LabelRangeCheck(3):
        F.cross_entropy(torch.zeros(4, 3), torch.zeros(4, dtype=torch.long))
