"""ajet: train LLM agents with reinforcement learning without rewriting them.

The public API a workflow author needs: `Workflow`, `WorkflowOutput`, `Tuner`, `Task`. Importing ajet
does not import torch, transformers or the HTTP server.
"""

from ajet.task import Task
from ajet.workflow import Tuner, Workflow, WorkflowOutput

__version__ = "0.1.0"
__all__ = ["Task", "Tuner", "Workflow", "WorkflowOutput", "__version__"]
