"""Variants of ``PipeMLP`` and its data that once broke Bamboo (issue 7, "bugs found by trying it").

Each trains unchanged under ``strategy="auto"``; the worker script picks one with ``--variant`` / ``--data``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import Tensor, nn
from torch.utils.data import Dataset
from typing_extensions import override

from lightning_bamboo.models import GPT
from lightning_bamboo.strategy import full_forward
from tests.bamboo.pipe_mlp import PipeMLP


class PerLayerLr(PipeMLP):
    """One param group per layer, learning rate growing with the layer's index in the whole body.

    Stage 0's groups (layers 0, 2) and stage 1's (layers 4, 6) have different learning rates, so a replica
    that copied its own rank's hyper-parameters would step with the wrong ones.
    """

    @override
    def configure_optimizers(self):  # type: ignore[override]
        groups = [
            {"params": list(layer.parameters()), "lr": self.lr * (1 + int(name) / 4)}
            for name, layer in self.pipeline.named_children()
            if any(True for _ in layer.parameters())
        ]
        optimizer = torch.optim.SGD(groups, lr=self.lr, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class HeadLr(PipeMLP):
    """A param group for the head picked as ``self.pipeline[-1]``, ten times the learning rate of the rest.

    On stage 0 of 2 (layers 0-2) a stage body indexed from 0 would give ``pipeline[-1]`` = layer 2, which
    would then train with the head's learning rate (and the head on stage 1 would too): silently wrong.
    """

    @override
    def configure_optimizers(self):  # type: ignore[override]
        head = list(self.pipeline[-1].parameters())
        rest = [p for p in self.parameters() if all(p is not h for h in head)]
        groups = [{"params": rest}, {"params": head, "lr": self.lr * 10}]
        return torch.optim.SGD(groups, lr=self.lr, momentum=0.9, nesterov=True)


class ColumnMajorLinear(nn.Linear):
    """A Linear whose output has the same shape and values but column-major strides (as ``x.transpose``
    leaves them): a stage ending with it sends a non-contiguous activation and receives its gradient."""

    @override
    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x).t().contiguous().t()


class StridedOutput(PipeMLP):
    """PipeMLP whose stage 0 of 2 (layers 0-2) ends with a :class:`ColumnMajorLinear` (same weights)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        plain = self.pipeline[2]
        strided = ColumnMajorLinear(plain.in_features, plain.out_features).to(plain.weight.dtype)
        strided.load_state_dict(plain.state_dict())
        self.pipeline[2] = strided


class Unused(nn.Module):
    """Identity with a trainable parameter that takes no part in the forward, so its ``.grad`` stays None."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.unused = nn.Parameter(torch.ones(width, dtype=torch.float64))

    def forward(self, x: Tensor) -> Tensor:
        return x


class WithUnused(PipeMLP):
    """PipeMLP whose last stage ends with an unused parameter (Adam with weight decay would move it)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.pipeline.append(Unused(1))


class Affine(nn.Module):
    """``x * scale + shift`` with a frozen parameter ``scale`` and a buffer ``shift``."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(width, dtype=torch.float64), requires_grad=False)
        self.register_buffer("shift", torch.zeros(width, dtype=torch.float64))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.scale + self.shift


class WithState(PipeMLP):
    """PipeMLP whose second half holds a BatchNorm (running stats) and a frozen parameter plus a buffer."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        width = self.pipeline[0].in_features
        layers = list(self.pipeline)
        tail = [nn.BatchNorm1d(width).to(torch.float64), Affine(width)]
        self.pipeline = nn.Sequential(*layers[:-1], *tail, layers[-1])

    def perturb_state(self, seed: int) -> None:
        """Frozen parameter and buffers drawn from ``seed`` (as an unseeded init would, per rank)."""
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for module in self.pipeline:
                if isinstance(module, Affine):
                    module.scale.copy_(1 + 0.1 * torch.randn(module.scale.shape, generator=generator))
                    module.shift.copy_(0.1 * torch.randn(module.shift.shape, generator=generator))
                if isinstance(module, nn.BatchNorm1d):
                    assert module.running_mean is not None
                    module.running_mean.copy_(torch.randn(module.running_mean.shape, generator=generator))


class InplaceFirst(PipeMLP):
    """Linear, Tanh, Linear | LeakyReLU(inplace=True), Linear, Tanh, Linear: stage 1 of 2 starts in place.

    (Not an idempotent op like ReLU, whose second application would hide a corrupted activation.)
    """

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        layers = list(self.pipeline)  # L T L T L T L
        self.pipeline = nn.Sequential(*layers[:3], nn.LeakyReLU(0.1, inplace=True), *layers[4:])


class UserModel(WithState):
    """What a user writes (issue 17): BatchNorm statistics, a frozen parameter and a buffer, a parameter that
    never gets a gradient, and AdamW over two param groups — the head (``self.pipeline[-1]``) at a tenth of
    the learning rate without weight decay, the rest with weight decay — under a per-step scheduler.

    A replica that zero-fills missing gradients (AdamW decays and steps the unused parameter), steps with its
    own rank's group settings, or never receives buffers ends away from ``strategy="auto"``.
    """

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        layers = list(self.pipeline)
        self.pipeline = nn.Sequential(*layers[:-1], Unused(layers[-1].in_features), layers[-1])

    @override
    def configure_optimizers(self):  # type: ignore[override]
        head = list(self.pipeline[-1].parameters())
        rest = [p for p in self.parameters() if p.requires_grad and all(p is not h for h in head)]
        groups = [
            {"params": rest, "weight_decay": 0.05},
            {"params": head, "lr": self.lr / 10, "weight_decay": 0.0},
        ]
        optimizer = torch.optim.AdamW(groups, lr=self.lr)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class WithDropout(PipeMLP):
    """PipeMLP with ``Dropout(0.5)`` after every Tanh: L T D L T D L T D L (3 pairs).

    2 stages split it L T D L | T D L T D L, 3 stages L T D | L T D | L T D L: every stage and every replica
    draws masks, and stage 0 of 3 ends with a Dropout (its output has exact zeros where it dropped).
    Dropout draws no numbers at construction, so the parameters start as ``PipeMLP``'s.
    """

    def __init__(self, p: float = 0.5, **kwargs) -> None:
        super().__init__(**kwargs)
        layers: list[nn.Module] = []
        for layer in self.pipeline:
            layers.append(layer)
            if isinstance(layer, nn.Tanh):
                layers.append(nn.Dropout(p))
        self.pipeline = nn.Sequential(*layers)


class Tied(PipeMLP):
    """PipeMLP whose third Linear IS its first (one weight, two uses; biases stay separate): L T L T L' T H
    with ``L'.weight = L.weight``. 2 stages put the uses on stages 0 and 1, 3 stages on stages 0 and 2."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.pipeline[4].weight = self.pipeline[0].weight


class TiedGPT(GPT):
    """A tiny GPT-2 (token + position embedding, 2 blocks, LayerNorm + LM head) whose LM head IS the token
    embedding's weight, as GPT-2 and nanoGPT tie them; float64, no dropout, AdamW with weight decay on
    matrices (the tied one included) and warm-up + cosine schedule. Trains on random token windows
    (:meth:`make_data`). Layers ``[Embedding, Block, Block, Head]``: the uses sit on the first and last
    stage for 2 and 3 stages."""

    VOCAB = 16
    LENGTH = 8

    def __init__(self, dtype: str = "float64", **_: object) -> None:
        super().__init__(vocab_size=self.VOCAB, block_size=self.LENGTH, n_layer=2, n_head=2, n_embd=16,
                         lr=1e-2, warmup=2)
        self.pipeline.to(getattr(torch, dtype))
        self.pipeline[-1].lm.weight = self.pipeline[0].tok.weight

    @classmethod
    def make_data(cls, num_samples: int, seed: int = 1234) -> tuple[Tensor, Tensor]:
        """``(ids, next ids)``: random windows of ``LENGTH`` tokens."""
        tokens = torch.randint(0, cls.VOCAB, (num_samples, cls.LENGTH + 1),
                               generator=torch.Generator().manual_seed(seed))
        return tokens[:, :-1], tokens[:, 1:]


class TiedGPTNamed(TiedGPT):
    """``TiedGPT`` with the usual name-based AdamW recipe (issue 28): no weight decay on embeddings, norms and
    biases (``"tok"``/``"pos"``/``"ln"``/``"bias"`` in the name), decay on the rest. Under ``auto`` the tied
    weight is listed once, as ``pipeline.0.tok.weight`` (no decay); a stage holding the head sees its copy as
    ``pipeline.3.lm.weight``, which this grouping alone would decay."""

    NO_DECAY = ("tok", "pos", "ln", "bias")

    @override
    def optimizer_groups(self) -> list[dict[str, object]]:
        named = [(n, p) for n, p in self.named_parameters() if p.requires_grad]
        plain = [p for n, p in named if any(k in n for k in self.NO_DECAY)]
        decayed = [p for n, p in named if not any(k in n for k in self.NO_DECAY)]
        return [{"params": decayed, "weight_decay": 0.1}, {"params": plain, "weight_decay": 0.0}]


class Residual(nn.Module):
    """``x + body(x)``: a residual block as one layer of the pipeline body."""

    def __init__(self, *layers: nn.Module) -> None:
        super().__init__()
        self.body = nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.body(x)


class WithBatchNorm(PipeMLP):
    """A small BatchNorm network: L BN1d T [L BN1d T]+ D | unflatten BN2d flatten L T L, float64, dropout on.

    ``BatchNorm1d`` layers (one inside a residual block) and a ``BatchNorm2d`` over the 8 features seen as 2
    channels of 2 x 2, so both stages of a 2-stage split hold BatchNorm running statistics. Its validation
    and training losses are logged with ``sync_dist=True``."""

    def __init__(self, width: int = 8, dtype: str = "float64", **kwargs: object) -> None:
        super().__init__(width=width, dtype=dtype, **kwargs)  # type: ignore[arg-type]
        self.pipeline = nn.Sequential(
            nn.Linear(width, width), nn.BatchNorm1d(width), nn.Tanh(),
            Residual(nn.Linear(width, width), nn.BatchNorm1d(width), nn.Tanh()), nn.Dropout(0.2),
            nn.Unflatten(1, (2, 2, width // 4)), nn.BatchNorm2d(2), nn.Flatten(),
            nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 1),
        ).to(getattr(torch, dtype))

    @override
    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = self.pipeline_loss(self.pipeline(self.pipeline_inputs(batch)), batch)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    @override
    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = self.pipeline_loss(self.pipeline(self.pipeline_inputs(batch)), batch)
        self.log("val_loss", loss, sync_dist=True)
        # what the replayed body refuses (a metric on the outputs), written as its error says
        outputs = full_forward(self, self.pipeline_inputs(batch))
        self.log("val_full_mse", F.mse_loss(outputs, batch[1]), sync_dist=True)
        return loss


VARIANTS: dict[str, type[LightningModule]] = {
    "batchnorm": WithBatchNorm,
    "mlp": PipeMLP,
    "per-layer-lr": PerLayerLr,
    "head-lr": HeadLr,
    "strided": StridedOutput,
    "unused": WithUnused,
    "state": WithState,
    "inplace": InplaceFirst,
    "user": UserModel,
    "dropout": WithDropout,
    "tied": Tied,
    "tied-gpt": TiedGPT,
    "tied-gpt-named": TiedGPTNamed,
}


class RankNoise(Dataset):
    """Adds noise to inputs AND targets from a generator seeded by the process's global rank.

    Stands for random augmentation/masking in a dataset whose random stream differs between processes
    (Lightning's worker seeding depends on the global rank): the stages of one pipeline load different
    samples from the same indices. Rank 0 of a Bamboo run draws exactly what the single-process reference
    draws, call for call.
    """

    def __init__(self, x: Tensor, y: Tensor) -> None:
        self.x, self.y = x, y
        self.generator: torch.Generator | None = None

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        if self.generator is None:
            rank = dist.get_rank() if dist.is_initialized() else 0
            self.generator = torch.Generator().manual_seed(1000 + rank)
        x, y = self.x[index], self.y[index]
        noise_x = torch.randn(x.shape, generator=self.generator, dtype=x.dtype)
        noise_y = torch.randn(y.shape, generator=self.generator, dtype=y.dtype)
        return x + 0.1 * noise_x, y + 0.1 * noise_y
