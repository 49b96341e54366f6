"""Worker script: train GCN or GAT with ``DorylusStrategy`` on N graph servers and record losses and weights.

Launched by ``tests/dorylus/test_strategy.py``, one process per graph server started together
(``tests.process.run_ranks``; run alone, Lightning's popen launcher starts the others by re-running it).
Rank 0 writes ``result.json`` (per-epoch global train loss
and val accuracy); every rank writes ``weights_rank{r}.safetensors`` so the test can check that the weight
replicas stayed identical. The test builds the same graph and model with :func:`make_graph` and
:func:`make_model` and trains them in one process as the reference.

Usage: python exact_run.py OUT_DIR --model gcn|gat|sage --servers N --executor local|inline [--epochs 5]
       [--dropout 0.0] [--staleness S] [--stale-reads freshest|oldest] [--intervals auto|K]
       python exact_run.py OUT_DIR --servers N --cases CASES_JSON
With ``--cases`` (``{name: [--model ..., --executor ..., ...]}``) every case trains in turn in this one launch
(a Trainer and a strategy per case; the imports and the process group paid once), into ``OUT_DIR/<name>``.
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

import torch
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from safetensors.torch import save_file
from torch.utils.data import DataLoader, IterableDataset
from torch_geometric.data import Data
from torch_geometric.utils import to_undirected

from lightning_dorylus import GAT, GCN, DorylusStrategy, GraphSAGE
from lightning_dorylus.data import GraphPartition, partition_graph

NUM_NODES, NUM_FEATURES, NUM_CLASSES, INTERVAL_SIZE = 240, 12, 4, 32


def make_graph(seed: int = 0) -> Data:
    """A small undirected float64 random graph with homophilous labels and train/val/test masks."""
    gen = torch.Generator().manual_seed(seed)
    y = torch.randint(0, NUM_CLASSES, (NUM_NODES,), generator=gen)
    src = torch.randint(0, NUM_NODES, (4 * NUM_NODES,), generator=gen)
    dst = torch.randint(0, NUM_NODES, (4 * NUM_NODES,), generator=gen)
    edge_index = to_undirected(torch.stack([src, dst]), num_nodes=NUM_NODES)
    edge_index = edge_index[:, edge_index[0] != edge_index[1]]
    centroids = torch.randn(NUM_CLASSES, NUM_FEATURES, generator=gen, dtype=torch.float64)
    x = centroids[y] + 2.0 * torch.randn(NUM_NODES, NUM_FEATURES, generator=gen, dtype=torch.float64)
    split = torch.rand(NUM_NODES, generator=gen)
    return Data(
        x=x,
        edge_index=edge_index,
        y=y,
        train_mask=split < 0.3,
        val_mask=(split >= 0.3) & (split < 0.6),
        test_mask=split >= 0.6,
    )


def make_model(name: str, seed: int = 0, dropout: float = 0.0, hidden: int = 16) -> LightningModule:
    """The model under test, float64. One process and N servers compute the same function even with
    ``dropout > 0``: masks are keyed by (seed, epoch, step, site, global vertex/edge id)."""
    seed_everything(seed, verbose=False)
    if name == "gcn":
        model: LightningModule = GCN(
            NUM_FEATURES, hidden, NUM_CLASSES, dropout=dropout, lr=0.05, weight_decay=5e-4
        )
    elif name == "gat":
        model = GAT(
            NUM_FEATURES, 4, NUM_CLASSES, heads=3, out_heads=2, dropout=dropout, lr=0.05, weight_decay=5e-4
        )
    elif name == "sage":
        model = GraphSAGE(NUM_FEATURES, 16, NUM_CLASSES, dropout=dropout, lr=0.05, weight_decay=5e-4)
    else:
        raise ValueError(f"--model {name!r}: expected 'gcn', 'gat' or 'sage'")
    return model.double()


class OnePartition(IterableDataset):
    """Yields one graph server's partition once per epoch."""

    def __init__(self, partition: GraphPartition) -> None:
        self.partition = partition

    def __iter__(self):
        yield self.partition


def loader(partition: GraphPartition) -> DataLoader:
    return DataLoader(OnePartition(partition), batch_size=None, collate_fn=lambda p: p)


class Recorder(Callback):
    """Keeps the global train loss and val accuracy of every epoch."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.val_acc: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(trainer.callback_metrics["train_loss"]))

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking:
            self.val_acc.append(float(trainer.callback_metrics["val_acc"]))


def train(
    model: LightningModule, partitions: list[GraphPartition], epochs: int, strategy, devices: int, extra=()
):
    """Fits ``model`` on ``partitions[trainer.global_rank]``; returns the trainer and the recorder."""
    recorder = Recorder()
    trainer = Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_epochs=epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[recorder, *extra],
    )
    part = partitions[trainer.global_rank]
    trainer.fit(model, train_dataloaders=loader(part), val_dataloaders=loader(part))
    return trainer, recorder


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--model", default="gcn")
    parser.add_argument("--servers", type=int, default=2)
    parser.add_argument("--executor", default="inline")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--staleness", type=int, default=None)
    parser.add_argument("--stale-reads", default="freshest", help="DorylusStrategy(stale_reads=...)")
    parser.add_argument("--hidden", type=int, default=16, help="GCN hidden width (< 12: weight-first)")
    parser.add_argument("--intervals", default=None, help="'auto' or an int (DorylusStrategy(intervals=...))")
    parser.add_argument("--cases", type=Path, default=None, help="JSON {name: [arguments]}, one launch")
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    partitions = partition_graph(make_graph(), args.servers, partitioner="metis", interval_size=INTERVAL_SIZE)
    if args.cases is None:
        run_case(args, partitions)
        return
    for name, argv in json.loads(args.cases.read_text()).items():
        print(f"exact_run: case {name}", flush=True)
        case = parse_args([str(args.out / name), "--servers", str(args.servers), *argv])
        case.out.mkdir(parents=True, exist_ok=True)
        run_case(case, partitions)


def checksum(t: torch.Tensor) -> float:
    """Position-weighted sum (a plain sum of a last layer's gradient rows is 0: softmax); equal tensors give
    bitwise equal checksums."""
    flat = t.detach().contiguous().reshape(-1)
    return (flat * torch.linspace(1.0, 2.0, flat.numel(), dtype=flat.dtype)).sum().item()


def tap_exchange(exchange, sent: list, read: list) -> None:
    """Records, per message, a checksum of what this server sends to its peer (2 servers) and of what each
    read uses, with the epochs: the test matches every read against the peer's send of the epoch read."""

    def post_rows(h_local, partition, layer, epoch):
        (peer,) = [p for p in range(partition.num_parts) if p != partition.part_id]
        sent.append(["rows", layer, epoch, checksum(h_local[partition.send_index[peer]])])
        return original_rows(h_local, partition, layer, epoch)

    def post_grads(grad_ghost, partition, layer, epoch):
        sent.append(["grads", layer, epoch, checksum(grad_ghost)])
        return original_grads(grad_ghost, partition, layer, epoch)

    def take(layer, direction, epoch):
        chosen = original_take(layer, direction, epoch)
        if direction == "rows":
            total = checksum(chosen.buffer)
        else:
            (total,) = [checksum(rows) for _, rows in chosen.received]
        read.append([direction, layer, epoch, chosen.epoch, total])
        return chosen

    original_rows, original_grads, original_take = exchange.post_rows, exchange.post_grads, exchange.take
    exchange.post_rows, exchange.post_grads, exchange.take = post_rows, post_grads, take


def run_case(args: argparse.Namespace, partitions: list[GraphPartition]) -> None:
    """Trains one case on ``args.servers`` graph servers and writes its results under ``args.out``."""
    options = {"num_workers": 1} if args.executor == "local" else {}
    strategy = DorylusStrategy(
        executor=args.executor,
        executor_options=options,
        # rendezvous + collectives: on a busy machine 3 servers importing torch on 2 cores can take > 60 s
        timeout=datetime.timedelta(seconds=180),
        staleness=args.staleness,
        stale_reads=args.stale_reads,
        intervals=None
        if args.intervals is None
        else args.intervals
        if args.intervals == "auto"
        else int(args.intervals),
    )
    model = make_model(args.model, dropout=args.dropout, hidden=args.hidden)
    stale = {}

    class StaleStats(Callback):  # read before teardown drops the runtime
        def on_fit_start(self, trainer, pl_module) -> None:
            exchange = strategy.runtime.stale_exchange if strategy.runtime is not None else None
            if exchange is not None and args.servers == 2:
                tap_exchange(exchange, stale.setdefault("sent", []), stale.setdefault("read", []))

        def on_train_end(self, trainer, pl_module) -> None:
            exchange = strategy.runtime.stale_exchange if strategy.runtime is not None else None
            if exchange is not None:
                stale.update(reads=exchange.reads, waits=exchange.waits, max_age=exchange.max_age,
                             ages={str(age): n for age, n in sorted(exchange.ages.items())})
            if strategy.runtime is not None:
                ahead = strategy.runtime.runahead
                stale.update(runahead_used=ahead.used, runahead_dropped=ahead.dropped)
            if strategy.tuned is not None:
                stale.update(
                    tuned_intervals=strategy.tuned.num_intervals, tuned_in_flight=strategy.tuned.max_in_flight
                )
                stale.update(
                    intervals_used=len(pl_module._graphs.context(partitions[trainer.global_rank]).intervals)
                )

    trainer, recorder = train(
        model, partitions, args.epochs, strategy, devices=args.servers, extra=[StaleStats()]
    )
    rank = trainer.global_rank
    (args.out / f"stale_rank{rank}.json").write_text(json.dumps(stale))
    collectives = {  # DorylusStrategy's own collectives (no pickle), checked by the test
        "broadcast_str": strategy.broadcast(f"from-{rank}"),
        "broadcast_path": str(strategy.broadcast(Path(f"/tmp/rank{rank}"))),
        "broadcast_path_type": type(strategy.broadcast(Path(f"/tmp/rank{rank}"))).__name__,
        "broadcast_tensor": strategy.broadcast(torch.arange(3.0) * (rank + 1)).tolist(),
        "reduce_sum": strategy.reduce(torch.tensor(rank + 1.0), reduce_op="sum").item(),
        "all_gather": strategy.all_gather(torch.tensor([rank])).view(-1).tolist(),
    }
    (args.out / f"collectives_rank{rank}.json").write_text(json.dumps(collectives))
    weights = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    save_file(weights, str(args.out / f"weights_rank{rank}.safetensors"))
    if rank == 0:
        ghosts = [p.n_ghost for p in partitions]
        result = {"losses": recorder.losses, "val_acc": recorder.val_acc, "ghosts": ghosts}
        (args.out / "result.json").write_text(json.dumps(result))




if __name__ == "__main__":
    main()
