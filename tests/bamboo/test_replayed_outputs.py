"""What the usual validation code meets under Bamboo: ``acc(self.pipeline(x), y)`` in a replayed step fails
naming Bamboo and what to write instead (never computes on the input, as it would if the body returned it),
and ``example_input_array`` with Lightning's model summary is refused naming the summary."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelSummary
from lightning.pytorch.plugins.precision import Precision
from torch import nn

from lightning_bamboo._lightning.seam import StageBody
from lightning_bamboo.wiring import check_setup
from tests.bamboo.pipe_mlp import PipeMLP

WHAT_INSTEAD = r"lightning_bamboo.strategy.full_forward\(self, self.pipeline_inputs\(batch\)\)"


def _replaying_module() -> tuple[PipeMLP, StageBody]:
    module = PipeMLP()
    seam = StageBody("PipeMLP", "pipeline", dict(enumerate(module.pipeline)), len(module.pipeline))
    seam.attach(module)
    return module, seam


def test_the_bodys_outputs_in_a_replayed_step_serve_pipeline_loss_only() -> None:
    module, seam = _replaying_module()
    x, y = torch.randn(4, 8, dtype=torch.float64), torch.randn(4, 1, dtype=torch.float64)
    loss = torch.tensor(0.25, dtype=torch.float64)
    with seam.replaying(loss):
        outputs = module.pipeline(module.pipeline_inputs((x, y)))
        assert module.pipeline_loss(outputs, (x, y)) is loss  # the usual loss line works
        uses = [
            lambda: outputs.ndim,  # torchmetrics' first look at its preds
            lambda: outputs.argmax(dim=1),
            lambda: F.mse_loss(outputs, y),  # any torch function
            lambda: outputs == y,
            lambda: outputs[0],
            lambda: float(outputs),
        ]
        for use in uses:
            with pytest.raises(TypeError, match=rf"PipeMLP.pipeline\(...\).*BambooStrategy.*{WHAT_INSTEAD}"):
                use()


def test_example_input_array_with_the_model_summary_is_refused_naming_it() -> None:
    module = PipeMLP()
    module.example_input_array = torch.randn(2, 8, dtype=torch.float64)
    trainer = SimpleNamespace(callbacks=[ModelSummary()], gradient_clip_val=None, accumulate_grad_batches=1)
    with pytest.raises(ValueError, match=r"PipeMLP.example_input_array with Lightning's model summary.*"
                                         r"enable_model_summary=False"):
        check_setup(trainer, module, Precision(), None)  # type: ignore[arg-type]
    check_setup(SimpleNamespace(callbacks=[], gradient_clip_val=None, accumulate_grad_batches=1),  # type: ignore[arg-type]
                module, Precision(), None)
    module.example_input_array = None
    check_setup(trainer, module, Precision(), None)  # type: ignore[arg-type]
    assert isinstance(module.pipeline, nn.Sequential)
