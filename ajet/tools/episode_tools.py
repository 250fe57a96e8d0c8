"""One episode's view of the run's tools: the schemas, per-episode limits, and the record of every call.

`EpisodeTools` is what `tuner.tools` / `await tuner.call_tool(...)` use. Every call, allowed or not, becomes a
`ToolResult` appended to `records` (stored on the episode as `Episode.tool_calls`); `tool_metrics` turns a
step's episodes into `tools/calls`, `tools/errors`, `tools/timeouts` (and the same per tool).
"""

from __future__ import annotations

import json
import statistics
from typing import TYPE_CHECKING, Any

from ajet.tool_types import ToolCaller, ToolResult

if TYPE_CHECKING:
    from ajet.episode import Episode


class EpisodeTools:
    """The tools of one episode: `schemas` (OpenAI format) and `call` with a per-episode call limit.

    Args:
        hub: the run's tools, e.g. its `McpHub` (owns the servers, applies the per-call timeout).
        max_calls: calls allowed in this episode; later calls get a "limit" error result without reaching a server.
    """

    def __init__(self, hub: ToolCaller, max_calls: int):
        self.hub, self.max_calls = hub, max_calls
        self.records: list[ToolResult] = []

    @property
    def schemas(self) -> list[dict[str, Any]]:
        """The run's tools as OpenAI-format function schemas (what `tuner.tools` returns)."""
        return self.hub.schemas

    async def call(self, name: str, arguments: dict[str, Any] | str | None = None) -> ToolResult:
        """Call tool `name` with `arguments` (a dict, or the JSON text a model wrote); never raises for
        anything the tool, its server or the arguments do: failures are error results."""
        if len(self.records) >= self.max_calls:
            result = ToolResult(name, arguments, f"error: the limit of {self.max_calls} tool calls per episode "
                                f"is reached; answer with what you have", True, "limit")
        else:
            parsed = _parse_arguments(arguments)
            if isinstance(parsed, str):
                result = ToolResult(name, arguments, parsed, True, "bad_arguments")
            else:
                result = await self.hub.call(name, parsed)
        self.records.append(result)
        return result


def _parse_arguments(arguments: dict[str, Any] | str | None) -> dict[str, Any] | str:
    """A dict of arguments, or an error text for the model."""
    if arguments is None or arguments == "":
        return {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as exc:
            return f"error: the arguments are not valid JSON ({exc.msg} at char {exc.pos}); send a JSON object"
    if not isinstance(arguments, dict):
        return f"error: the arguments must be a JSON object, got {type(arguments).__name__}"
    return arguments


def tool_metrics(episodes: list[Episode]) -> dict[str, float]:
    """A step's tool figures over all its episodes (failed ones too: their calls happened).

    Returns: {"tools/calls", "tools/errors", "tools/timeouts", "tools/calls_per_episode",
    "tools/duration_s_mean"} plus "tools/calls/<tool>", "tools/errors/<tool>", "tools/timeouts/<tool>";
    empty when no episode called a tool. Calls of tools that do not exist count under "_unknown".
    """
    records = [r for e in episodes for r in e.tool_calls]
    if not records:
        return {}
    m: dict[str, float] = {
        "tools/calls": len(records),
        "tools/errors": sum(r.is_error for r in records),
        "tools/timeouts": sum(r.error_kind == "timeout" for r in records),
        "tools/calls_per_episode": len(records) / len(episodes),
        "tools/duration_s_mean": statistics.fmean(r.duration_s for r in records),
    }
    def key(r: ToolResult) -> str:   # names the model invented share one bucket (no metric per typo)
        return "_unknown" if r.error_kind == "unknown_tool" else r.name

    for name in sorted({key(r) for r in records}):
        mine = [r for r in records if key(r) == name]
        m[f"tools/calls/{name}"] = len(mine)
        m[f"tools/errors/{name}"] = sum(r.is_error for r in mine)
        m[f"tools/timeouts/{name}"] = sum(r.error_kind == "timeout" for r in mine)
    return m
