"""Moved to `ajet.tools.sandbox`; this name stays importable for existing workflows."""

from ajet.tools.sandbox import SandboxResult, SandboxUnavailable, bwrap_status, run_python, run_python_async

__all__ = ["SandboxResult", "SandboxUnavailable", "bwrap_status", "run_python", "run_python_async"]
