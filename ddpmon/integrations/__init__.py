"""Integrations with training frameworks: each module imports its framework only when used.

- ``ddpmon.integrations.lightning``: ``DdpmonCallback`` for Lightning (``lightning`` or
  ``pytorch_lightning``; ``ddpmon.integrations.pytorch_lightning`` for the latter explicitly).
- ``ddpmon.integrations.transformers``: ``DdpmonCallback``, a Hugging Face ``TrainerCallback``.
- ``ddpmon.integrations.accelerate``: what ``ddpmon.attach(..., accelerator=...)`` takes from an
  ``accelerate.Accelerator``.

``import ddpmon`` never imports any of them.
"""
