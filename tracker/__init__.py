"""ajet's context tracker (installed as `ajet.tracker`): recorded calls -> training samples."""

from ajet.tracker.context_tracker import merge_calls
from ajet.tracker.sample import Sample

__all__ = ["Sample", "merge_calls"]
