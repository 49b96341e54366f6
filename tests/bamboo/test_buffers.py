"""The buffer rule's pieces on one process (:mod:`lightning_bamboo.pipeline.buffers`): deferred running
statistics over a batch's micro-batches equal BatchNorm's own update from the whole batch; the warning and the
refusals name what is possible. The rule across pipelines is asserted end to end in test_batch_norm.py."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_bamboo.pipeline.buffers import (
    StageBuffers,
    batch_norm_split_warning,
    check_batch_norm_mode,
    refuse_sync_batchnorm,
)


@pytest.mark.parametrize("momentum", [0.1, None], ids=["momentum", "cumulative"])
@pytest.mark.parametrize(("kind", "shape"), [
    (nn.BatchNorm1d, (12, 3)), (nn.BatchNorm1d, (12, 3, 5)), (nn.BatchNorm2d, (12, 3, 4, 4)),
], ids=["1d", "1d-length", "2d"])
def test_deferred_statistics_equal_the_whole_batchs_update(
    kind: type[nn.Module], shape: tuple[int, ...], momentum: float | None
) -> None:
    """4 micro-batches, 3 batches: the running statistics (and ``num_batches_tracked``) equal one BatchNorm
    given each whole batch; each micro-batch is still normalized by its own statistics and back-propagates."""
    whole = kind(3).double()
    whole.momentum = momentum
    deferred = copy.deepcopy(whole)
    rule = StageBuffers("deferred")
    generator = torch.Generator().manual_seed(0)
    for _ in range(3):
        x = 5 + 2 * torch.randn(shape, generator=generator, dtype=torch.float64)  # a mean far from 0
        whole(x)
        rule.begin({0: [deferred]}, split=4)
        for part in x.chunk(4):
            own = copy.deepcopy(deferred)
            out = deferred(part)
            torch.testing.assert_close(out, own(part), rtol=0, atol=0)
            out.pow(2).sum().backward()  # the forward's graph is intact (no buffer it holds was rewritten)
        rule.finish({0: [deferred]}, {}, {}, num_pipelines=1)
    assert int(deferred.num_batches_tracked) == int(whole.num_batches_tracked) == 3
    torch.testing.assert_close(deferred.running_mean, whole.running_mean, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(deferred.running_var, whole.running_var, rtol=1e-12, atol=1e-14)


def test_broadcast_rule_and_a_whole_batch_leave_batch_norm_alone() -> None:
    """``batch_norm="broadcast"``, or one micro-batch in all: BatchNorm's own update, no hook left behind."""
    layer, reference = nn.BatchNorm1d(2).double(), nn.BatchNorm1d(2).double()
    x = torch.randn(6, 2, dtype=torch.float64)
    for rule, split in ((StageBuffers("broadcast"), 4), (StageBuffers("deferred"), 1)):
        rule.begin({0: [layer]}, split=split)
        layer(x)
        reference(x)
        rule.finish({0: [layer]}, {}, {}, num_pipelines=1)
        assert not layer._forward_pre_hooks and not layer._forward_hooks
    assert torch.equal(layer.running_mean, reference.running_mean)
    assert torch.equal(layer.running_var, reference.running_var)


def test_hooks_follow_the_layers_held() -> None:
    """A layer no longer held (given up at a re-form) loses its hooks; evaluation forwards are not counted."""
    a, b = nn.BatchNorm1d(2).double(), nn.BatchNorm1d(2).double()
    rule = StageBuffers("deferred")
    rule.begin({0: [a], 1: [b]}, split=2)
    a.eval()
    a(torch.randn(4, 2, dtype=torch.float64))
    rule.finish({0: [a], 1: [b]}, {}, {}, num_pipelines=1)
    assert int(a.num_batches_tracked) == 0 and int(b.num_batches_tracked) == 0  # nothing ran in training
    rule.begin({1: [b]}, split=2)
    assert not a._forward_pre_hooks and b._forward_pre_hooks


def test_bad_mode_sync_batchnorm_and_the_warning() -> None:
    with pytest.raises(ValueError, match=r"batch_norm must be one of 'broadcast', 'deferred', got 'sync'"):
        check_batch_norm_mode("sync")
    body = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    with pytest.raises(ValueError, match=r"Trainer\(sync_batchnorm=True\).*batch_norm='deferred'"):
        refuse_sync_batchnorm(object(), body, "Net", "pipeline")
    with pytest.raises(ValueError, match=r"nn.SyncBatchNorm \(pipeline.1\).*batch_norm='deferred'"):
        refuse_sync_batchnorm(None, nn.Sequential(nn.Linear(2, 2), nn.SyncBatchNorm(2)), "Net", "pipeline")
    refuse_sync_batchnorm(None, body, "Net", "pipeline")
    assert batch_norm_split_warning("Net", "pipeline", body, 1, 1, "broadcast") is None
    two = batch_norm_split_warning("Net", "pipeline", body, 1, 2, "broadcast")  # two pipelines, M = 1
    assert two is not None and "split into 2 micro-batches" in two and "pipeline.1" in two
    assert "batch_norm='deferred'" in two
    micro = batch_norm_split_warning("Net", "pipeline", body, 2, 1, "deferred")  # one pipeline, M = 2
    assert micro is not None and "split into 2 micro-batches (num_microbatches=2 x 1 pipelines)" in micro
    plain = nn.Sequential(nn.Linear(2, 2))
    assert batch_norm_split_warning("Net", "pipeline", plain, 4, 2, "deferred") is None
