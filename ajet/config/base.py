"""The base of every config section: unknown keys are refused and assignments are validated."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def describe(err: dict[str, Any]) -> str:
    """One line for one of pydantic's validation errors: the dotted key, the message and the value given (a check
    across sections: its own message, which names the keys)."""
    key = ".".join(str(p) for p in err["loc"])
    if err["type"] == "missing":
        return f"missing required key `{key}`"
    if not key:   # a check across sections (its message names the keys), e.g. `agents`
        return str(err["msg"]).removeprefix("Value error, ")
    return f"`{key}`: {err['msg']} (got {err.get('input')!r})"
