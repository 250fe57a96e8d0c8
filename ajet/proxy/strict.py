"""`strict: true` tools: the generated arguments checked against the tool's JSON schema.

OpenAI's hosted models decode strict tools under a grammar, so their arguments always match the schema.
ajet samples freely (a constrained decoder would change the distribution the policy is trained on), so
the proxy accepts `strict`, validates the arguments the policy wrote with `jsonschema`, answers them
unchanged, and records each violation on the call (`LLMCall.strict_violations`; the trainer counts them
per step as `rollout/strict_violations`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import jsonschema
from jsonschema.exceptions import SchemaError


@dataclass(frozen=True)
class StrictTools:
    """Validators of a request's strict tools, by function name."""

    validators: dict[str, Any]

    @classmethod
    def of(cls, tools: list[dict[str, Any]] | None) -> StrictTools | None:
        """The strict tools of OpenAI wire `tools` (`{"type": "function", "function": {..., "strict": true}}`),
        or None when there are none. Raises ValueError naming the tool when a strict tool's `parameters`
        is not a valid JSON schema (the proxy answers a 400)."""
        validators = {}
        for t in tools or []:
            fn = t.get("function") or {}
            if not fn.get("strict"):
                continue
            schema = fn.get("parameters") or {"type": "object", "properties": {}}
            cls_ = jsonschema.validators.validator_for(schema)
            try:
                cls_.check_schema(schema)
            except SchemaError as exc:
                raise ValueError(f"tool {fn.get('name')!r} has strict: true but its parameters are not a valid "
                                 f"JSON schema: {exc.message[:200]}") from None
            validators[fn["name"]] = cls_(schema)
        return cls(validators) if validators else None

    def violations(self, tool_calls: list[dict[str, Any]]) -> list[str]:
        """One message per tool call to a strict tool whose arguments break its schema (wire-format
        `tool_calls`, `arguments` a JSON string), e.g. `"calculate: 'expression' is a required property"`."""
        out = []
        for tc in tool_calls:
            name = tc["function"]["name"]
            validator = self.validators.get(name)
            if validator is None:
                continue
            try:
                args = json.loads(tc["function"]["arguments"])
                error = next(iter(validator.iter_errors(args)), None)
                problem = None if error is None else (
                    error.message[:200] + (f" (at {'/'.join(map(str, error.absolute_path))})"
                                           if error.absolute_path else ""))
            except ValueError:
                problem = "the arguments are not valid JSON"
            except RecursionError:
                problem = "the arguments are nested too deeply to validate"
            if problem is not None:
                out.append(f"{name}: {problem}")
        return out
