"""The tool types a workflow sees: one tool call's `ToolResult`, and `ToolCaller`, what calls tools.

They sit low (below `ajet.workflow` and `ajet.episode`, which hold and record them) so that the types never
import the tools that implement them: `ajet.tools.episode_tools.EpisodeTools` (one episode's tools, with its
call limit) and `ajet.tools.mcp_hub.McpHub` (the run's MCP servers) are both `ToolCaller`s.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal, Protocol

ErrorKind = Literal["tool_error", "timeout", "limit", "unknown_tool", "bad_arguments", "server_down"]


@dataclass
class ToolResult:
    """One tool call and its result, as the model sees it and as the episode records it.

    Attributes:
        name: the tool's name as the model called it.
        arguments: the parsed arguments (the raw text when they were not a JSON object).
        text: the result text for the `tool` message (an error says what went wrong, as real agents see it).
        is_error: the call failed (error_kind says how).
        error_kind: None, "tool_error" (the server's tool reported an error), "timeout", "limit" (the
            episode's call limit), "unknown_tool", "bad_arguments" or "server_down" (crashed or unreachable).
        server: the MCP server that owns the tool ("" when none does).
        duration_s: seconds from the call to the result.
    """

    name: str
    arguments: Any
    text: str
    is_error: bool = False
    error_kind: ErrorKind | None = None
    server: str = ""
    duration_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable form (trajectories.jsonl, the trajectory store)."""
        return asdict(self)


class ToolCaller(Protocol):
    """What calls tools: their OpenAI-format function `schemas`, and `call`, which never raises for what a
    tool, its server or the arguments do (failures are error results)."""

    @property
    def schemas(self) -> list[dict[str, Any]]: ...

    async def call(self, name: str, arguments: Any) -> ToolResult: ...
