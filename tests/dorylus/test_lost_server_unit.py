"""What ``lost_server`` takes for a lost peer, and the resume it names, without launching servers."""

from __future__ import annotations

import torch.distributed as dist

from lightning_dorylus.executors import ExecutorError
from lightning_dorylus.lost_server import is_peer_failure, resume_hint


def test_only_the_backends_errors_are_taken_for_a_lost_peer() -> None:
    assert is_peer_failure(dist.DistBackendError("[gloo/tcp/pair.cc:537] Connection closed by peer"))
    assert is_peer_failure(RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection "
                                        "reset by peer"))
    assert not is_peer_failure(ExecutorError("op 'apply_vertex.forward' (interval 0) failed after 3 "
                                             "attempt(s): Task timed out after 60 seconds"))
    assert not is_peer_failure(RuntimeError("user code: connection refused by my database"))


def test_without_a_checkpoint_the_hint_says_how_to_get_one() -> None:
    hint = resume_hint(None)
    assert hint.startswith("No checkpoint was saved, so the run starts over: with "
                           "ModelCheckpoint(save_last=True)") and 'ckpt_path="last"' in hint
