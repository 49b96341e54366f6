"""Bad BambooStrategy configurations fail early, with errors that print the values and the arithmetic."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn

from lightning_bamboo import BambooStrategy
from lightning_bamboo.pipeline.microbatch import split_microbatches
from lightning_bamboo.runtime.formation import checked_body, layer_costs, plan_stages
from lightning_bamboo.wiring import check_precision

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_stages": 0}, r"num_stages must be an integer >= 1, got 0"),
        ({"num_microbatches": 0}, r"num_microbatches must be an integer >= 1, got 0"),
        ({"replica_device": "gpu"}, r"replica_device must be 'same' or 'cpu', got 'gpu'"),
        ({"num_stages": 1}, r"recovery='replica' needs num_stages >= 2 .* got num_stages \(1\)"),
        ({"recovery": "mirror"}, r"recovery must be one of 'replica', 'replica\+forward', 'peers', got 'mir"),
        ({"recovery": "peers", "redundancy": True}, r"recovery=.peers. and redundancy=True disagree"),
        ({"heartbeat": 0}, r"heartbeat=0: expected seconds > 0, or None for the default"),
        ({"batch_norm": "sync"}, r"batch_norm must be one of 'broadcast', 'deferred', got 'sync'"),
    ],
)
def test_bad_arguments(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        BambooStrategy(**kwargs)


def test_world_size_not_a_multiple_of_stages() -> None:
    with pytest.raises(ValueError, match=r"num_stages \(3\) does not divide world_size \(4\): 4 % 3 = 1"):
        Trainer(strategy=BambooStrategy(num_stages=3), accelerator="cpu", devices=4, logger=False)


def test_more_stages_than_layers() -> None:
    body = nn.Sequential(nn.Linear(2, 2), nn.Tanh(), nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"num_stages \(4\) is more than the 3 layers of the pipeline body"):
        plan_stages(body, 4, layer_costs(body, None))


def test_layer_costs_must_cover_every_layer() -> None:
    body = nn.Sequential(nn.Linear(2, 2), nn.Tanh(), nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"layer_costs has 1 entries but the pipeline body has 3 layers"):
        plan_stages(body, 2, layer_costs(body, [1.0]))


def test_microbatches_must_divide_the_batch() -> None:
    batch = (torch.zeros(6, 3), torch.zeros(6))
    match = r"batch size \(6\) is not divisible by num_microbatches \(4\): 6 % 4 = 2"
    with pytest.raises(ValueError, match=match):
        split_microbatches(batch, 4)


def test_split_microbatches_keeps_structure() -> None:
    batch = {"x": torch.arange(8).view(4, 2), "y": [torch.arange(4), "tag"]}
    parts = split_microbatches(batch, 2)
    assert [p["x"].tolist() for p in parts] == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    assert [p["y"][0].tolist() for p in parts] == [[0, 1], [2, 3]]
    assert all(p["y"][1] == "tag" for p in parts)


def test_tensors_disagreeing_on_batch_size() -> None:
    with pytest.raises(ValueError, match=r"batch size 4 on dimension 0 .* shape \(3,\)"):
        split_microbatches((torch.zeros(4, 2), torch.zeros(3)), 2)


def test_sixteen_bit_mixed_precision_is_refused() -> None:
    scaler = torch.amp.GradScaler("cpu")
    strategy = BambooStrategy(precision_plugin=MixedPrecision("16-mixed", "cpu", scaler=scaler))
    with pytest.raises(ValueError, match=r"does not support precision='16-mixed'"):
        check_precision(strategy.precision_plugin)


def test_module_left_with_one_stage_is_refused() -> None:
    from lightning_bamboo.contract import _STAGE_MARK, sub_sequential
    from tests.bamboo.pipe_mlp import PipeMLP

    model = PipeMLP()
    model.pipeline = sub_sequential(model.pipeline, range(3))
    setattr(model.pipeline, _STAGE_MARK, True)
    with pytest.raises(RuntimeError, match=r"PipeMLP.pipeline holds only the layers of one stage"):
        checked_body(model, None, 2, None)


def test_peers_with_one_pipeline_is_warned_at_start() -> None:
    """``recovery="peers"`` recovers a lost stage from another pipeline: with one pipeline there is none."""
    import warnings

    from lightning_bamboo.layout.ownership import initial
    from lightning_bamboo.runtime.formation import Formation

    cpu = torch.device("cpu")
    peers = Formation(2, 2, False, True, None, device=lambda: cpu, replica_device=lambda: cpu)
    with pytest.warns(UserWarning, match=r"recovery='peers' with one pipeline"):
        peers.warn_if_unrecoverable(initial(2, range(2)))
    replica = Formation(2, 2, True, True, None, device=lambda: cpu, replica_device=lambda: cpu)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        peers.warn_if_unrecoverable(initial(2, range(4)))  # two pipelines: each is the other's peer
        replica.warn_if_unrecoverable(initial(2, range(2)))


def test_sync_batchnorm_is_refused_naming_deferred_statistics() -> None:
    """``Trainer(sync_batchnorm=True)`` reaches the strategy as Lightning's layer sync; setup refuses it (the
    pipeline cannot normalize by the global batch) and names ``batch_norm='deferred'``, never ignores it."""
    from types import SimpleNamespace

    from lightning_bamboo.strategy import check_batch_norm
    from tests.bamboo.pipe_mlp import PipeMLP

    model = PipeMLP()
    model.pipeline.insert(1, nn.BatchNorm1d(8).double())
    formation = SimpleNamespace(layers=dict(enumerate(model.pipeline)), body_attr="pipeline",
                                global_microbatches=2, num_microbatches=1)
    trainer = Trainer(accelerator="cpu", devices=1, strategy=BambooStrategy(), sync_batchnorm=True,
                      logger=False)
    with pytest.raises(ValueError, match=r"Trainer\(sync_batchnorm=True\) with BambooStrategy \(PipeMLP\).*"
                                         r"batch_norm='deferred'"):
        check_batch_norm(model, formation, trainer.strategy._layer_sync, "broadcast")
    with pytest.warns(UserWarning, match=r"PipeMLP.pipeline has BatchNorm layers \(pipeline.1\): the global "
                                         r"batch is split into 2 micro-batches \(num_microbatches=1 x 2"):
        check_batch_norm(model, formation, None, "broadcast")  # two pipelines with M = 1 warn too



@pytest.mark.parametrize(("redundancy", "mode"), [(True, "replica+forward"), (False, "peers")])
def test_redundancy_is_deprecated_for_recovery(redundancy: bool, mode: str) -> None:
    """``redundancy=`` still works, with a warning at the user's line naming ``recovery=`` and the value."""
    with pytest.warns(DeprecationWarning, match=rf"redundancy={redundancy}\) is deprecated: pass "
                                                rf"recovery='{re.escape(mode)}' instead") as caught:
        strategy = BambooStrategy(num_stages=2, redundancy=redundancy)
    assert strategy._options.recovery == mode
    assert {w.filename for w in caught if "is deprecated" in str(w.message)} == {__file__}


def test_the_recipes_spell_the_recovery_mode_one_way() -> None:
    """The shipped strategy recipes set ``recovery`` (the documented default), never ``redundancy``."""
    recipes = sorted((REPO_ROOT / "recipes" / "conf" / "strategy").glob("bamboo*.yaml"))
    assert recipes
    for recipe in recipes:
        keys = [line.split(":")[0] for line in recipe.read_text().splitlines()
                if line and not line.startswith(("#", " "))]
        assert "redundancy" not in keys and "recovery" in keys, recipe
