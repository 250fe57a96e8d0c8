"""Tools from MCP servers (`tools:`) and the built-in tool-loop agent's settings."""

from __future__ import annotations

from pydantic import Field, model_validator

from ajet.config.base import _Section


class McpServerConfig(_Section):
    """One MCP server, in the common `mcpServers` shape: a stdio `command` (+ `args`, `env`, `cwd`) that ajet
    starts, or the `url` of a streamable-HTTP server that ajet connects to (+ `headers`).

    A stdio server gets only `env` plus the `mcp` package's safe defaults (HOME, PATH, ...), never the
    trainer's whole environment; `command: python` means the trainer's own interpreter; `cwd` (default: the
    config file's folder) is where relative `args` resolve.
    """

    command: str | None = Field(None, description="a stdio server's program, started by ajet (`python` means the "
                                                  "trainer's own interpreter)")
    args: list[str] = Field(default_factory=list, description="its arguments; relative paths resolve in cwd")
    env: dict[str, str] = Field(
        default_factory=dict, description="its environment: only these plus the `mcp` package's safe defaults (HOME, "
                                          "PATH, ...), never the trainer's")
    cwd: str | None = Field(None, description="its working folder (None: the config file's folder)")
    url: str | None = Field(None, description="the URL of a streamable-HTTP server ajet connects to, e.g. "
                                              "http://127.0.0.1:8000/mcp")
    headers: dict[str, str] = Field(
        default_factory=dict, description="HTTP headers sent to `url` (e.g. Authorization)")

    @model_validator(mode="after")
    def _one_transport(self) -> McpServerConfig:
        if (self.command is None) == (self.url is None):
            raise ValueError("give exactly one of `command` (a stdio server ajet starts) or `url` (a "
                             "streamable-HTTP server, e.g. http://127.0.0.1:8000/mcp)")
        return self


class ToolAgentConfig(_Section):
    """The built-in `ajet.tool_agent:ToolAgent` workflow: a Chat Completions tool loop over `tuner.tools`.

    first_tool_choice: `tool_choice` of the first turn: "auto", "required", or a tool's name (small models
    rarely start a tool call on their own); later turns use "auto". The episode ends at the first reply
    without a tool call (its text is the final answer) or after max_turns model calls.
    """

    system_prompt: str = Field(
        "You are a helpful assistant. Use the tools to find the answer, then reply with it.", description="the system"
                                                                                                          " message "
                                                                                                          "of every "
                                                                                                          "episode")
    max_turns: int = Field(4, ge=1, description="most model calls per episode; the episode ends earlier at the first "
                                                "reply without a tool call")
    first_tool_choice: str = Field("auto", description="`tool_choice` of the first turn: auto, required, or a tool's "
                                                       "name; later turns use auto")


class ToolsConfig(_Section):
    """Tools from MCP servers, given to workflows as `tuner.tools` / `await tuner.call_tool(...)`.

    The servers are started (or connected) once per run, pinged before an episode when idle for
    health_check_interval_s, restarted when dead, and stopped at the end. Limits are per episode: a call
    beyond max_calls_per_episode, one past call_timeout_s, or a server error is an error result the model
    sees, recorded on the episode and counted per step (tools/calls, tools/errors, tools/timeouts).
    """

    mcp_servers: dict[str, McpServerConfig] = Field(
        default_factory=dict, description="MCP servers by name, in the common `mcpServers` shape (the keys below)")
    max_calls_per_episode: int = Field(16, ge=1, description="tool calls an episode may make; a call beyond is an "
                                                             "error result the model sees")
    call_timeout_s: float = Field(30.0, gt=0, description="per tool call, seconds")
    startup_timeout_s: float = Field(60.0, gt=0, description="per server start, seconds")
    health_check_interval_s: float = Field(1.0, ge=0, description="ping a server idle this long before an episode")
    max_result_chars: int = Field(8000, gt=0, description="longer tool results are cut, with a marker")
    agent: ToolAgentConfig = Field(
        default_factory=ToolAgentConfig, description="the built-in `ajet.tool_agent:ToolAgent` workflow's settings")
