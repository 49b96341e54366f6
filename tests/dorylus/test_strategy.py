"""DorylusStrategy: N graph servers (subprocesses, gloo) train exactly what one process trains.

Each case trains ``scripts/exact_run.py`` (GCN, GAT or GraphSAGE, float64, 5 epochs) on 2 or 3 graph
servers and compares its per-epoch global loss, val accuracy and final weights with the same model trained
in this process under ``strategy="auto"`` on the single whole-graph partition. Three cases train with
dropout on: masks are keyed by global vertex/edge ids, so N servers draw exactly the one-process masks.
The cases are batched: one launch of 2 graph servers trains every 2-server case in turn (a Trainer and a
strategy per case), one launch of 3 every 3-server case; the start-up (imports, popen launch, process group)
is what a launch costs, not the 5 epochs.
"""

from __future__ import annotations

import datetime
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from safetensors.torch import load_file

from lbd_common.broadcast import encode_object
from lightning_dorylus import GCN, DorylusStrategy
from lightning_dorylus.data import partition_graph
from tests.dorylus.scripts.exact_run import INTERVAL_SIZE, loader, make_graph, make_model, train
from tests.dorylus.scripts.launch import SCRIPTS, run_script


def broadcast_header(obj: object) -> bytes:
    """What ``DorylusStrategy.broadcast``'s source sends first (``b""``: every rank raises)."""
    return encode_object(obj, "DorylusStrategy.broadcast")


EPOCHS = 5

# case name -> servers, exact_run.py arguments
EXACT_CASES: dict[str, tuple[int, list[str]]] = {
    f"{model}-{servers}-{executor}-{dropout}": (
        servers, ["--model", model, "--executor", executor, "--dropout", str(dropout)]
    )
    for model, servers, executor, dropout in [
        ("gcn", 2, "local", 0.0), ("gcn", 3, "inline", 0.0), ("gat", 2, "inline", 0.0),
        ("gat", 3, "local", 0.0), ("sage", 2, "local", 0.0), ("gcn", 3, "inline", 0.5),
        ("gat", 2, "inline", 0.5), ("sage", 2, "inline", 0.5),
    ]
}
EXACT_CASES["staleness0-gcn-auto"] = (
    2, ["--model", "gcn", "--executor", "inline", "--staleness", "0", "--intervals", "auto", "--hidden", "8",
        "--dropout", "0.5"]
)
EXACT_CASES["staleness1-gcn"] = (  # the deterministic reads: always epoch e - 1's ghosts
    2, ["--model", "gcn", "--executor", "local", "--staleness", "1", "--stale-reads", "oldest",
        "--hidden", "8"]
)
EXACT_CASES["staleness2-gcn"] = (  # S = 2: the first layer runs ahead, so ghosts may be only 1 epoch old
    2, ["--model", "gcn", "--executor", "local", "--staleness", "2", "--stale-reads", "oldest",
        "--hidden", "8"]
)
EXACT_CASES["staleness0-gat"] = (
    2, ["--model", "gat", "--executor", "local", "--staleness", "0", "--dropout", "0.5"]
)
EXACT_CASES["staleness1-gat"] = (2, ["--model", "gat", "--executor", "inline", "--staleness", "1"])


def _run_batch(out: Path, servers: int) -> dict[str, Path]:
    cases = {
        name: [*argv, "--epochs", str(EPOCHS)] for name, (n, argv) in EXACT_CASES.items() if n == servers
    }
    (out / "cases.json").write_text(json.dumps(cases))
    run_script("exact_run.py", [str(out), "--servers", str(servers), "--cases", str(out / "cases.json")],
               timeout=300 + 60 * len(cases), cwd=out, nprocs=servers)
    return {name: out / name for name in cases}


@pytest.fixture(scope="module")
def exact_runs(tmp_path_factory: pytest.TempPathFactory):
    """``exact_runs(servers)`` -> case name -> output folder; each server count's batch launched once."""
    done: dict[int, dict[str, Path] | AssertionError] = {}

    def get(servers: int) -> dict[str, Path]:
        if servers not in done:
            try:
                done[servers] = _run_batch(tmp_path_factory.mktemp(f"exact{servers}"), servers)
            except AssertionError as failed:  # every case of the batch reports it; none relaunches it
                done[servers] = failed
        result = done[servers]
        if isinstance(result, AssertionError):
            raise result
        return result

    return get


def reference(
    model_name: str, dropout: float = 0.0, hidden: int = 16
) -> tuple[dict, dict[str, torch.Tensor]]:
    """One process, one partition (the whole graph), inline executor: the single-process full-graph run."""
    partitions = partition_graph(make_graph(), 1, partitioner="metis", interval_size=INTERVAL_SIZE)
    model = make_model(model_name, dropout=dropout, hidden=hidden)
    _, recorder = train(model, partitions, EPOCHS, strategy="auto", devices=1)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"losses": recorder.losses, "val_acc": recorder.val_acc}, weights


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize(
    ("model_name", "servers", "executor", "dropout"),
    [
        ("gcn", 2, "local", 0.0), ("gcn", 3, "inline", 0.0), ("gat", 2, "inline", 0.0),
        ("gat", 3, "local", 0.0), ("sage", 2, "local", 0.0), ("gcn", 3, "inline", 0.5),
        ("gat", 2, "inline", 0.5), ("sage", 2, "inline", 0.5),
    ],
)
def test_graph_servers_match_single_process(
    exact_runs, model_name: str, servers: int, executor: str, dropout: float
) -> None:
    tmp_path = exact_runs(servers)[f"{model_name}-{servers}-{executor}-{dropout}"]
    result = json.loads((tmp_path / "result.json").read_text())
    assert all(g > 0 for g in result["ghosts"]), "every partition must have ghosts, or SC is not exercised"

    expected, expected_weights = reference(model_name, dropout)
    if dropout:  # the masks really change the run (else this case would prove nothing new)
        assert expected["losses"] != reference(model_name)[0]["losses"]
    assert len(result["losses"]) == EPOCHS
    torch.testing.assert_close(
        torch.tensor(result["losses"], dtype=torch.float64),
        torch.tensor(expected["losses"], dtype=torch.float64),
        rtol=1e-9,
        atol=1e-11,
    )
    assert result["val_acc"] == pytest.approx(expected["val_acc"], abs=1e-12)
    replicas = [load_file(str(tmp_path / f"weights_rank{r}.safetensors")) for r in range(servers)]
    for replica in replicas[1:]:  # the weight replicas never diverge
        for name, value in replica.items():
            torch.testing.assert_close(value, replicas[0][name], rtol=0, atol=0)
    for rank in range(servers):  # broadcast / reduce / all_gather of the strategy, seen from every rank
        got = json.loads((tmp_path / f"collectives_rank{rank}.json").read_text())
        assert got == {
            "broadcast_str": "from-0",
            "broadcast_path": "/tmp/rank0",
            "broadcast_path_type": "PosixPath",
            "broadcast_tensor": [0.0, 1.0, 2.0],
            "reduce_sum": float(servers * (servers + 1) // 2),
            "all_gather": list(range(servers)),
        }
    assert set(replicas[0]) == set(expected_weights)
    for name, value in expected_weights.items():
        torch.testing.assert_close(replicas[0][name], value, rtol=1e-9, atol=1e-11)


def test_broadcast_header_refuses_what_json_cannot_carry() -> None:
    assert json.loads(broadcast_header(Path("/a/b"))) == {"kind": "path", "value": "/a/b"}
    assert json.loads(broadcast_header(torch.zeros(2, 3, dtype=torch.float64))) == {
        "kind": "tensor",
        "dtype": "float64",
        "shape": [2, 3],
    }
    assert json.loads(broadcast_header({"a": [1, None]})) == {
        "kind": "json",
        "value": {"a": [1, None]},
    }
    assert broadcast_header(object()) == b""


def test_mmap_threshold_returns_freed_buffers_to_the_os() -> None:
    # one interpreter (the import of lightning_dorylus paid once), each mode measured in a forked child
    out = subprocess.run(
        [sys.executable, str(SCRIPTS / "heap_release.py"), "both"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    released = {k: float(v) for k, v in (item.split("=") for item in out.stdout.split()[-2:])}
    assert released["set"] >= 150, released  # 39 x 4 MiB back to the OS at once
    assert released["unset"] < released["set"], released  # glibc's default keeps them on the heap


def test_bad_mmap_threshold_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"mmap_threshold=-1 must be None or between 0 and 33554432 bytes"):
        DorylusStrategy(mmap_threshold=-1)


def test_unknown_executor_name_is_rejected() -> None:
    with pytest.raises(
        ValueError,
        match=r"executor='lambada' is not known; valid executors are \['inline', 'lambda', 'local'\]",
    ):
        DorylusStrategy(executor="lambada")


def test_executor_of_wrong_type_is_rejected() -> None:
    with pytest.raises(TypeError, match=r"executor must be a name in .* or a TensorOpExecutor, got int"):
        DorylusStrategy(executor=3)  # type: ignore[arg-type]


def test_batch_that_is_not_a_partition_is_rejected() -> None:
    strategy = DorylusStrategy(executor="inline")
    with pytest.raises(TypeError, match=r"expects each batch to be a GraphPartition .* got dict"):
        strategy.batch_to_device({"x": torch.zeros(2)})


def test_partition_of_wrong_size_is_rejected() -> None:
    strategy = DorylusStrategy(executor="inline")  # no cluster environment: world_size 1, rank 0
    part = partition_graph(make_graph(), 2, partitioner="metis", interval_size=INTERVAL_SIZE)[1]
    with pytest.raises(
        ValueError, match=r"graph server 0 of world_size \(1\) got partition 1 of num_parts \(2\)"
    ):
        strategy.batch_to_device(part)


def test_model_rejects_non_partition_batch() -> None:
    model = make_model("gcn")
    with pytest.raises(TypeError, match=r"GCN expects a GraphPartition batch .* got Tensor"):
        model.training_step(torch.zeros(3), 0)


def test_num_parts_must_equal_world_size() -> None:
    """A DataModule that declares num_parts != world_size fails in setup, before any training."""

    class TwoParts:
        num_parts = 2

    strategy = DorylusStrategy(executor="inline")
    trainer = Trainer(accelerator="cpu", devices=1, strategy=strategy, logger=False)
    trainer.datamodule = TwoParts()  # type: ignore[assignment]
    with pytest.raises(ValueError, match=r"num_parts \(2\) != world_size \(1\)"):
        strategy._check_datamodule(trainer)


def test_single_process_fit_with_strategy_instance(tmp_path: Path) -> None:
    """A 1-server DorylusStrategy (no process group) trains and the layers get its executor, then lose it."""
    partitions = partition_graph(make_graph(), 1, partitioner="metis", interval_size=INTERVAL_SIZE)
    model: GCN = make_model("gcn")  # type: ignore[assignment]
    strategy = DorylusStrategy(executor="inline", timeout=datetime.timedelta(seconds=30))
    seen = []
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        max_epochs=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        default_root_dir=tmp_path,
    )
    original = model.training_step

    def training_step(batch, batch_idx):
        seen.append(model.convs[0]._runtime.executor is strategy.executor)
        return original(batch, batch_idx)

    model.training_step = training_step  # type: ignore[method-assign]
    try:
        trainer.fit(model, train_dataloaders=loader(partitions[0]), val_dataloaders=loader(partitions[0]))
    finally:  # a 1-process group was created in this (pytest) process; leave nothing behind
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    assert seen == [True, True]
    assert model.convs[0]._runtime is None and strategy.executor is None
    assert 0.0 <= float(trainer.callback_metrics["val_acc"]) <= 1.0


def test_model_without_dorylus_layers_is_rejected() -> None:
    from lightning.pytorch.demos.boring_classes import BoringModel

    strategy = DorylusStrategy(executor="inline")
    strategy.connect(BoringModel())
    with pytest.raises(TypeError, match=r"BoringModel has no DorylusLayer .* only trains models built from"):
        strategy._start_runtime()
    assert strategy.executor is None  # nothing was started


@pytest.mark.multiprocess
@pytest.mark.slow
def test_pipeline_engine_staleness_zero_is_exact(exact_runs) -> None:
    """staleness=0: the per-interval AV -> GA pipeline of weight-first GCN layers (12 -> 8 -> 4: layer 1's
    dropped-out input made per interval, layer 2's a tensor needing its gradient, SC of both through the
    exchange) trains what one process trains, with dropout, also after ``intervals="auto"`` re-cuts the
    partitions from the first epoch's measured requests. (Gather-first layers: ``test_nn.py``.)"""
    tmp_path = exact_runs(2)["staleness0-gcn-auto"]
    result = json.loads((tmp_path / "result.json").read_text())
    expected, expected_weights = reference("gcn", dropout=0.5, hidden=8)
    torch.testing.assert_close(
        torch.tensor(result["losses"]), torch.tensor(expected["losses"]), rtol=1e-9, atol=1e-11
    )
    weights = load_file(str(tmp_path / "weights_rank0.safetensors"))
    for rank in range(2):
        tuned = json.loads((tmp_path / f"stale_rank{rank}.json").read_text())
        assert tuned["tuned_intervals"] >= 1 and tuned["tuned_in_flight"] >= 1
        assert tuned["intervals_used"] == tuned["tuned_intervals"]
    for name, value in expected_weights.items():
        torch.testing.assert_close(weights[name], value, rtol=1e-9, atol=1e-11)
    # GAT (12 -> 3 heads x 4 -> 2 heads, local executor): per-interval AE -> attention dropout -> GA, and
    # the explicit per-interval backward, over the wire format, with attention and feature dropout 0.5
    tmp_path = exact_runs(2)["staleness0-gat"]
    result = json.loads((tmp_path / "result.json").read_text())
    expected, expected_weights = reference("gat", dropout=0.5)
    torch.testing.assert_close(
        torch.tensor(result["losses"]), torch.tensor(expected["losses"]), rtol=1e-9, atol=1e-11
    )
    assert result["val_acc"] == pytest.approx(expected["val_acc"], abs=1e-12)
    for rank in range(2):
        weights = load_file(str(tmp_path / f"weights_rank{rank}.safetensors"))
        for name, value in expected_weights.items():
            torch.testing.assert_close(weights[name], value, rtol=1e-9, atol=1e-11)


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("case", ["staleness1-gcn", "staleness1-gat", "staleness2-gcn"])
def test_pipeline_engine_staleness_one_reads_ghosts_at_most_one_epoch_old(exact_runs, case: str) -> None:
    """staleness=1: the first epoch is exact (nothing older exists), ghosts are never more than 1 epoch old,
    and on several servers the first layer does not run ahead (its weights one update behind plus a ghost
    one epoch old would rest a gradient on weights 2 updates behind: over the bound). staleness=2: the
    run-ahead takes one epoch of the bound, so ghosts are still at most 1 epoch old and every later epoch's
    first-layer requests were sent ahead during the previous epoch (validation between epochs drains but
    keeps them). Replicas stay identical and the loss goes down (GAT: its first step). GCN reads with
    ``stale_reads="oldest"``: every
    read after epoch 0 uses the previous epoch's ghost rows and gradients (stale reads do happen). GAT reads
    the freshest arrived (timing decides which): after epoch 0 a read never waits, since last epoch's buffer
    (complete after the validation's drain) is fresh enough."""
    tmp_path = exact_runs(2)[case]
    result = json.loads((tmp_path / "result.json").read_text())
    expected, _ = reference("gcn", hidden=8) if case.endswith("gcn") else reference("gat")
    assert result["losses"][0] == pytest.approx(expected["losses"][0], rel=1e-9)
    if case != "staleness1-gat":
        assert result["losses"][-1] < result["losses"][0]
    else:  # half of a vertex's neighbours are ghosts here: with stale ghosts (Adam, lr 0.05) GAT's loss
        # rises in epochs 2-4 before it falls (20 epochs: 1.66 -> 1.17, synchronous 0.90); step 1 lowers it
        assert min(result["losses"][1:]) < result["losses"][0]
    for rank in range(2):
        stale = json.loads((tmp_path / f"stale_rank{rank}.json").read_text())
        # per epoch: SC and ∇SC of both layers (GCN weight-first: P = x W needs its gradient for ∇W;
        # GAT: [h | alpha_src] of the projection)
        assert stale["reads"] == 4 * EPOCHS
        assert 0 <= stale["max_age"] <= 1
        assert sum(stale["ages"].values()) == stale["reads"]
        if case != "staleness1-gat":  # oldest: epoch 0 exact, then always epoch e - 1's
            assert stale["ages"] == {"0": 4, "1": 4 * (EPOCHS - 1)}
        else:  # freshest: only epoch 0's reads can wait
            assert stale["waits"] <= 4, stale["waits"]
        # every read used exactly what the peer sent in the epoch it says (float64 checksums, bitwise)
        peer = json.loads((tmp_path / f"stale_rank{1 - rank}.json").read_text())
        sent = {(d, layer, epoch): total for d, layer, epoch, total in peer["sent"]}
        assert len(stale["read"]) == stale["reads"]
        for direction, layer, epoch, read_epoch, total in stale["read"]:
            assert epoch - 1 <= read_epoch <= epoch
            assert total == sent[(direction, layer, read_epoch)], (direction, layer, epoch, read_epoch)
        ahead = EPOCHS - 1 if case == "staleness2-gcn" else 0
        assert stale["runahead_used"] == ahead and stale["runahead_dropped"] == 0
    replicas = [load_file(str(tmp_path / f"weights_rank{r}.safetensors")) for r in range(2)]
    for name, value in replicas[1].items():
        torch.testing.assert_close(value, replicas[0][name], rtol=0, atol=0)


# the first layer's parameters its AV requests carry (GAT: gat.project reads all three, backward included)
FIRST_LAYER = {"gcn": ("convs.0", ("weight",)), "gat": ("conv1", ("weight", "att_src", "att_dst"))}


@pytest.mark.parametrize("model_name", ["gcn", "gat"])
def test_run_ahead_first_layer_reads_the_previous_weight_version(model_name: str, tmp_path: Path) -> None:
    """staleness=1 on one graph server (no ghosts, so deterministic): epoch ``e >= 1``'s first layer (GCN:
    weight-first; GAT: ``gat.project``) runs forward AND backward on the parameters of before epoch
    ``e - 1``'s update (its requests were sent during epoch ``e - 1``'s backward, and GAT's backward sends
    the version its forward used, not the current one) and its gradient updates the current parameters: the
    synchronous model trained with exactly that delay, by swapping the first layer's AV parameters around
    each step, gives the same losses and weights. Validation between epochs keeps the requests sent ahead; a
    checkpoint after every validation drops them, so that run is the synchronous one."""
    partitions = partition_graph(make_graph(), 1, partitioner="metis", interval_size=INTERVAL_SIZE)
    layer_name, param_names = FIRST_LAYER[model_name]

    class DelayFirstLayer(Callback):
        """Forward and backward of epoch e on W_{e-1}; the step applies the gradient to W_e."""

        def __init__(self) -> None:
            self.before_last_step: list[torch.Tensor] | None = None
            self.current: list[torch.Tensor] = []

        def params(self, pl_module) -> list[torch.Tensor]:
            layer = pl_module.get_submodule(layer_name)
            return [getattr(layer, name) for name in param_names]

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            self.current = [p.detach().clone() for p in self.params(pl_module)]
            if self.before_last_step is not None:
                for param, old in zip(self.params(pl_module), self.before_last_step):
                    param.data.copy_(old)

        def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
            for param, current in zip(self.params(pl_module), self.current):
                param.data.copy_(current)
            self.before_last_step = self.current

    class Counters(Callback):
        def __init__(self, name: str) -> None:
            self.name = name

        def on_train_end(self, trainer, pl_module) -> None:
            ahead = trainer.strategy.runtime.runahead
            counted[self.name] = {"used": ahead.used, "dropped": ahead.dropped}

    class CheckpointEveryEpoch(Callback):
        def on_validation_end(self, trainer, pl_module) -> None:
            trainer.save_checkpoint(tmp_path / f"epoch{trainer.current_epoch}.ckpt")

    def stale() -> DorylusStrategy:
        return DorylusStrategy(executor="inline", staleness=1, timeout=datetime.timedelta(seconds=30))

    hidden = {"hidden": 8} if model_name == "gcn" else {}
    runs, counted = {}, {}
    for name, strategy, extra in (
        ("delayed", "auto", [DelayFirstLayer()]),
        ("stale", stale(), [Counters("stale")]),
        ("checkpointed", stale(), [CheckpointEveryEpoch(), Counters("checkpointed")]),
    ):
        model = make_model(model_name, dropout=0.5, **hidden)
        if model_name == "gcn":
            assert model.convs[0].order == "weight_first"
        try:
            _, recorder = train(model, partitions, EPOCHS, strategy=strategy, devices=1, extra=extra)
        finally:
            if torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()
        runs[name] = (recorder.losses, {k: v.detach().clone() for k, v in model.state_dict().items()})
    assert counted == {"stale": {"used": EPOCHS - 1, "dropped": 0},
                       "checkpointed": {"used": 0, "dropped": EPOCHS - 1}}
    synchronous = reference(model_name, dropout=0.5, **hidden)[0]["losses"]
    torch.testing.assert_close(torch.tensor(runs["checkpointed"][0]), torch.tensor(synchronous), rtol=1e-9,
                               atol=1e-12)
    losses, weights = runs["stale"]
    assert losses[0] == pytest.approx(synchronous[0], rel=1e-12) and losses[1:] != synchronous[1:]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(runs["delayed"][0]), rtol=1e-9, atol=1e-12)
    for key, value in runs["delayed"][1].items():
        torch.testing.assert_close(weights[key], value, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("bad", [-1, 1.5, True])
def test_bad_staleness_is_rejected(bad) -> None:
    with pytest.raises(ValueError, match=r"staleness=.*: expected None \(synchronous\) or an int >= 0"):
        DorylusStrategy(staleness=bad)
