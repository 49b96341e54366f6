"""Named errors before any weight moves (issue 32): a PyG layer outside a Dorylus layer is refused at setup
(it would meet ghost ids in ``edge_index``: a bare ``IndexError``), and a model with fewer outputs than the
graph has classes fails at the loss of the first step with ``LabelRangeError`` (not torch's "Target out of
bounds"). One graph server in this process; ``test_model_checks_two_servers`` below runs both on two."""

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
from lightning.pytorch import Trainer
from torch import Tensor
from torch_geometric.nn import GCNConv as PygGCNConv

from lightning_dorylus import DorylusStrategy
from lightning_dorylus.data import GraphPartition, partition_graph
from lightning_dorylus.model_checks import LabelRangeCheck, LabelRangeError, check_foreign_layers, num_labels
from lightning_dorylus.nn import DorylusLayer
from tests.dorylus.scripts.exact_run import INTERVAL_SIZE, NUM_CLASSES, NUM_FEATURES, loader, make_graph
from tests.dorylus.scripts.user_module_run import UserGCN
from tests.process import REPO, run_ranks

FOREIGN = (r"PygGCN\.conv2 \(torch_geometric\.nn\.conv\.gcn_conv\.GCNConv\) is a PyG message-passing layer "
           r"outside a Dorylus layer: .*ghost vertices.*Use a Dorylus layer")
TOO_FEW = (rf"cross_entropy got {NUM_CLASSES - 1} class scores per vertex, but the graph's labels \(batch\.y "
           rf"on every graph server\) go up to {NUM_CLASSES - 1}: the model needs {NUM_CLASSES} outputs")


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


def test_enough_outputs_pass_and_unlabelled_vertices_do_not_count() -> None:
    assert num_labels(torch.tensor([-1, 0, 2, -1])) == 3
    assert num_labels(torch.tensor([-1, -1])) == 0 and num_labels(None) == 0
    assert num_labels(torch.ones(3)) == 0  # regression targets: nothing to check


@pytest.mark.multiprocess
def test_model_checks_two_servers(tmp_path: Path) -> None:
    """Both errors on 2 graph servers: every rank raises the named error (none waits in a collective)."""
    script = REPO / "tests" / "dorylus" / "scripts" / "model_checks_run.py"
    for case, expected in (("pyg", FOREIGN), ("too_few", TOO_FEW)):
        folder = tmp_path / case
        folder.mkdir()
        done = run_ranks([sys.executable, str(script), case], 2, timeout=240, cwd=folder)
        records = sorted(folder.glob("error_rank*.json"))
        assert [r.name for r in records] == ["error_rank0.json", "error_rank1.json"], done.stdout[-3000:]
        for record in records:
            error = json.loads(record.read_text())
            assert re.search(expected, f"{error['type']}: {error['message']}"), error


def test_loss_check_reads_input_by_keyword() -> None:
    with LabelRangeCheck(3), pytest.raises(LabelRangeError, match=r"cross_entropy got 2 class scores"):
        F.cross_entropy(input=torch.zeros(4, 2), target=torch.zeros(4, dtype=torch.long))
    with LabelRangeCheck(3):
        F.cross_entropy(torch.zeros(4, 3), torch.zeros(4, dtype=torch.long))
