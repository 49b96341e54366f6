"""Worker script: the engine (no Trainer) over batches whose micro-batch shape changes between steps.

``engine_shapes.py --out DIR --stages S`` starts S ranks (this file again with ``--rank``; gloo, one thread,
60 s collective timeout) that train ``PipeMLP``'s body with the redundant 1F1B schedule, SGD on every stage
and every replica (momentum 0.9), over batches of sizes ``SIZES`` (micro-batches of 2, 2, 1, 2, 1 rows),
then run one forward-only evaluation of 6 rows in 3 micro-batches. After every step each rank writes
``DIR/step{k}_rank{r}.safetensors``: ``loss``, ``own/<name>`` (its stage after the step),
``replica_used/<name>`` (its replica module as the step's ``FR`` used it), ``fwd/<mb>`` and ``fr/<mb>``
(its stage's and its replica's outputs) and ``pending`` (the replica exchange was left in flight);
``eval_rank{r}.safetensors`` holds the evaluation loss, the number of activation shapes the rank learned
from headers (``received``) and sent headers for (``sent``), and ``replica/<name>`` (the final replica,
read through ``ReplicaSync.replica``).
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors.torch import save_file

from lightning_bamboo import BambooGroups, PipelineEngine, ReplicaSync, split_microbatches
from lightning_bamboo.contract import sub_sequential
from lightning_bamboo.layout.plan import StageLayout
from lightning_bamboo.schedule import add_forward_redundancy, build_1f1b
from tests.bamboo.pipe_mlp import PipeMLP, make_data

SIZES = (4, 4, 2, 4, 2)
"""Batch sizes of the training steps: the micro-batch shape changes at steps 3, 4 and 5."""
MICROBATCHES = 2
LR = 0.05
MOMENTUM = 0.9


def body() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return PipeMLP(pairs=3).pipeline


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    x, y = make_data(sum(SIZES))
    bounds = torch.tensor((0, *SIZES)).cumsum(0).tolist()
    return [(x[a:b], y[a:b]) for a, b in itertools.pairwise(bounds)]


def eval_batch() -> tuple[torch.Tensor, torch.Tensor]:
    return make_data(6, seed=99)


def loss_fn(outputs: torch.Tensor, microbatch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.mse_loss(outputs, microbatch[1])


def worker(out: Path, rank: int, stages: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=stages, timeout=datetime.timedelta(seconds=60))
    try:
        full = body()
        layout = StageLayout.plan([1.0] * len(full), stages, stages)
        groups = BambooGroups.create(layout, rank)
        stage = sub_sequential(full, layout.stage_layers[groups.position])
        replica = sub_sequential(full, layout.stage_layers[layout.successor(groups.position)])
        schedule = add_forward_redundancy(build_1f1b(stages, MICROBATCHES), stages, MICROBATCHES)
        device = torch.device("cpu")
        engine = PipelineEngine(
            stage,
            groups,
            schedule,
            inputs_fn=lambda mb: mb[0],
            loss_fn=loss_fn,
            device=device,
            replica=replica,
        )
        optimizer = torch.optim.SGD(stage.parameters(), lr=LR, momentum=MOMENTUM)
        replica_optimizer = torch.optim.SGD(replica.parameters(), lr=LR, momentum=MOMENTUM)
        sync = ReplicaSync(stage, replica, replica_optimizer, groups, device)
        sync.sync_parameters()
        forwards: list[torch.Tensor] = []  # this stage's F outputs of the step, in micro-batch order
        stage.register_forward_hook(lambda module, args, output: forwards.append(output.detach().clone()))
        for step, batch in enumerate(batches(), start=1):
            forwards.clear()
            loss = engine.run_step(split_microbatches(batch, MICROBATCHES))
            # the module itself, not sync.replica: what the FR forwards of this step ran with, brought up to
            # date by the replica's forward pre-hook (the previous step's exchange was still pending)
            tensors = {f"replica_used/{k}": v.detach().clone() for k, v in replica.named_parameters()}
            tensors |= {f"fwd/{mb}": value for mb, value in enumerate(forwards)}
            tensors |= {f"fr/{mb}": value for mb, value in engine.redundant_outputs.items()}
            optimizer.step()
            sync.step(optimizer)
            optimizer.zero_grad()
            tensors["pending"] = torch.tensor([sync.pending])
            tensors["loss"] = loss.reshape(1)
            tensors |= {f"own/{k}": v.detach().clone() for k, v in stage.named_parameters()}
            save_file(tensors, str(out / f"step{step}_rank{rank}.safetensors"))
        final = {f"replica/{k}": v.detach().clone() for k, v in sync.replica.named_parameters()}
        val = engine.run_forward(split_microbatches(eval_batch(), 3))
        shapes = torch.tensor([len(engine.shapes.received), len(engine.shapes.sent)])
        save_file(
            {"loss": val.reshape(1), "received_sent": shapes, **final},
            str(out / f"eval_rank{rank}.safetensors"),
        )
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--stages", type=int, default=3)
    parser.add_argument("--rank", type=int, default=None)
    args = parser.parse_args()
    if args.rank is not None:
        worker(args.out, args.rank, args.stages)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    # children stay in this process group, so the test's killpg on timeout reaches them too
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--out",
                str(args.out),
                "--stages",
                str(args.stages),
                "--rank",
                str(r),
            ],
            env={**os.environ, "WORLD_SIZE": str(args.stages), "RANK": str(r)},
        )
        for r in range(args.stages)
    ]
    codes = [proc.wait() for proc in procs]
    if any(codes):
        raise SystemExit(f"ranks exited with {codes}")


if __name__ == "__main__":
    main()
