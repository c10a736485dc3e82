"""Lanes: the batched executors the owner thread steps. A lane owns its batch and caches."""

from .base import Lane, LaneStepStats, TokenEvent
from .text import TextLane

__all__ = ["Lane", "LaneStepStats", "TokenEvent", "TextLane"]
