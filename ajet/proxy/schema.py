"""The OpenAI Chat Completions request, as pydantic models (the wire schema the proxy accepts).

Responses reuse the `openai` package's own types (`ChatCompletion`, `ChatCompletionChunk`). Requests
get our own models because the `openai` request types are TypedDicts with lazy `Iterable` fields that
validate poorly; these mirror them field for field, discriminated on `role`, so a malformed request
gets one precise error (e.g. `messages.2.tool.tool_call_id: Field required`). `FunctionName` and
`json_schema_object` hold every dialect's tool declarations to the same rules.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, TypeAdapter, field_validator


class _Wire(BaseModel):
    # unknown message fields are kept (clients add vendor keys) and ignored by the template
    model_config = ConfigDict(extra="allow")


class TextPart(_Wire):
    type: Literal["text"]
    text: str


class FunctionCall(_Wire):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCall(_Wire):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


Content = Union[str, list[TextPart], None]


class SystemMessage(_Wire):
    role: Literal["system", "developer"]
    content: Content
    name: str | None = None


class UserMessage(_Wire):
    role: Literal["user"]
    content: Content
    name: str | None = None


class AssistantMessage(_Wire):
    role: Literal["assistant"]
    content: Content = None  # null or missing when the turn only calls tools
    tool_calls: list[ToolCall] | None = None
    name: str | None = None


class ToolMessage(_Wire):
    role: Literal["tool"]
    content: Content
    tool_call_id: str


Message = Annotated[Union[SystemMessage, UserMessage, AssistantMessage, ToolMessage], Field(discriminator="role")]


# a function (tool) name, as OpenAI's API accepts it; the other dialects' tool names are held to it too
FunctionName = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")]


def json_schema_object(v: dict[str, Any] | None) -> dict[str, Any] | None:
    """A function's parameters are a JSON-schema object: `type` "object" when given, `properties` a mapping of
    name -> schema object, `required` a list of names. Returns `v` unchanged; raises ValueError (a 400 naming the
    field, through pydantic) otherwise. Every dialect's tool parameters are checked with it."""
    if v is None:
        return v
    if "type" in v and v["type"] != "object":
        raise ValueError('must be a JSON schema of type "object" (got type ' + short_repr(v["type"]) + ")")
    props = v.get("properties")
    if props is not None and not isinstance(props, dict):
        raise ValueError("`properties` must be a mapping of parameter name -> JSON schema object")
    for name, schema in (props or {}).items():
        if not isinstance(schema, dict):
            raise ValueError(f"the schema of property {short_repr(name)} must be a JSON object")
    required = v.get("required")
    if required is not None and not (isinstance(required, list) and all(isinstance(r, str) for r in required)):
        raise ValueError("`required` must be a list of property names")
    return v


class FunctionDef(_Wire):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    _json_schema_object = field_validator("parameters")(json_schema_object)


class ToolDef(_Wire):
    type: Literal["function"]
    function: FunctionDef


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: dict[str, str]


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class ChatCompletionRequest(BaseModel):
    """`POST /v1/chat/completions` body. Unknown top-level fields are rejected with a 400 naming them; flags
    are JSON booleans (`"stream": "yes"` is a 400, not a stream)."""

    model_config = ConfigDict(extra="forbid")

    model: str
    messages: list[Message] = Field(min_length=1)
    tools: list[ToolDef] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    max_tokens: int | None = Field(None, gt=0)
    max_completion_tokens: int | None = Field(None, gt=0)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-2**63, le=2**63 - 1)
    n: int | None = Field(None, ge=1, le=16)  # choices per request; each is recorded as its own call
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    logprobs: StrictBool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: dict[str, Any] | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: StrictBool | None = None

    def wire_messages(self) -> list[dict[str, Any]]:
        """Messages as plain dicts, None-valued keys dropped (the form the chat template and records use): each
        message's `model_dump(exclude_none=True)`, the whole list in one call (40 messages: 29 us instead of 55)."""
        return _MESSAGES.dump_python(self.messages, exclude_none=True)

    def wire_tools(self) -> list[dict[str, Any]] | None:
        """Tools as plain dicts, None-valued keys dropped (each tool's `model_dump(exclude_none=True)`)."""
        return None if self.tools is None else _TOOLS.dump_python(self.tools, exclude_none=True)


_MESSAGES = TypeAdapter(list[Message])
_TOOLS = TypeAdapter(list[ToolDef])


def short_repr(value: Any, limit: int = 80) -> str:
    """`repr(value)` cut to about `limit` characters, so errors never echo huge inputs."""
    r = repr(value)
    return r if len(r) <= limit else r[:limit] + "..."
