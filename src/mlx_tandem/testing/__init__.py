"""Offline test models: ``make_tiny_model`` writes small random-weight checkpoints.

Also importable as a pytest plugin (``pytest_plugins = ["mlx_tandem.testing.pytest_plugin"]``)
that builds each kind once per test session.
"""

from .factory import KINDS, make_tiny_model

__all__ = ["KINDS", "make_tiny_model"]
