"""Example models that follow the Bamboo pipeline contract.

Each has ``pipeline`` (an ``nn.Sequential``), ``pipeline_inputs`` and ``pipeline_loss``.
"""

from lightning_bamboo.models.gpt import GPT, build_pipeline

__all__ = ["GPT", "build_pipeline"]
