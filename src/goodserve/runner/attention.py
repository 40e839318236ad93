"""Old home of the attention layer, now :mod:`goodserve.models.attention` (the model layer owns it).

A re-export kept only so that ``runner/model_runner.py`` works until its import reads
``from goodserve.models.attention import AttentionBackend, AttentionMetadata, TorchAttentionBackend``;
delete this file then. Nothing else imports it.
"""

from goodserve.models.attention import AttentionBackend, AttentionMetadata, TorchAttentionBackend

__all__ = ["AttentionBackend", "AttentionMetadata", "TorchAttentionBackend"]
