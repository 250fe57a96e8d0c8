"""ajet: train LLM agents with reinforcement learning without rewriting them.

The public API a workflow author needs: `Workflow`, `WorkflowOutput`, `Tuner`, `Task`, and `Job` to train from
Python (loaded on first use). Importing ajet does not import torch, transformers or the HTTP server.
"""

from typing import Any

from ajet.task import Task
from ajet.workflow import Tuner, Workflow, WorkflowOutput

__version__ = "0.1.0"
__all__ = ["Job", "Task", "Tuner", "Workflow", "WorkflowOutput", "__version__"]


def __getattr__(name: str) -> Any:
    """`ajet.Job` (ajet/job.py), imported when first used.

    Raises:
        AttributeError: ajet has no attribute `name`.
    """
    if name == "Job":
        from ajet.job import Job

        return Job
    raise AttributeError(f"module 'ajet' has no attribute {name!r}")
