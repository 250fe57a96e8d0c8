"""Tools for agents: the code sandbox (`ajet.tools.sandbox`)."""

from ajet.tools.sandbox import SandboxResult, SandboxUnavailable, bwrap_status, run_python, run_python_async

__all__ = ["SandboxResult", "SandboxUnavailable", "bwrap_status", "run_python", "run_python_async"]
