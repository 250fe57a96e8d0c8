"""Tools for agents: the code sandbox (`sandbox`, also an MCP server: `sandbox_server`), the run's MCP servers
(`mcp_hub`), and one episode's view of them with its limits and records (`episode_tools`). See docs/tools.md."""

from ajet.tools.sandbox import SandboxResult, SandboxUnavailable, bwrap_status, run_python, run_python_async

__all__ = ["SandboxResult", "SandboxUnavailable", "bwrap_status", "run_python", "run_python_async"]
