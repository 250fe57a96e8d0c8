"""Type-confusion fuzz of every request route: no answer is ever a 5xx, and the server keeps answering.

One real server on 127.0.0.1 (the proxy over a scripted engine, with `ajet serve`'s episode API mounted as
`ajet serve` composes them), driven by httpx. For each route (Chat Completions plain and streamed, Responses
plain and streamed, Messages plain and streamed, Messages count_tokens, Gemini generateContent /
streamGenerateContent / countTokens, the episode API's begin / finish / abort / heartbeat) the fuzz starts from
a valid request that uses most of the route's fields and, for every JSON path in it (the body itself
included), substitutes a value of each wrong type class of `WRONG_VALUES` (null, boolean, integer, float,
string, list, object: within a class the value rotates from path to path and route to route, so every value
of every class is sent: 0, -1, 2**70; 1.5, NaN; "", "x", a 100,000-character string; [], [null], a list
nested to just under the route's depth limit; {}, {"a": 1}) and adds an unknown key to every object.
`AJET_FUZZ_ALL_VALUES=1` sends every value at every path instead (about twice the requests). Per route it
also sends invalid UTF-8, lone-surrogate bytes, bodies that are not JSON objects, nesting past the limit, a
5,000-digit integer, and bodies at and one byte over the size limit.

Every answer must be below 500 (a dropped connection counts as a 5xx); every 4xx must be in the route's own
error shape (OpenAI's, Anthropic's, Google's) and, for a substituted path, name that path (or its top-level
field, or the field it conflicts with); a streamed 200 must not end in an internal-error event. The route's
valid request must succeed every `CHECK_EVERY` requests and after the last one.
"""

from __future__ import annotations

import copy
import json
import math
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import httpx
import pytest

from ajet.llm_call import SamplingParams
from ajet.proxy.server import MAX_JSON_DEPTH, ProxyServer
from ajet.rollout.episode_queue import TOKEN_HEADER, EpisodeQueue
from ajet.serve.api import MAX_BODY_BYTES as API_MAX_BODY_BYTES
from ajet.serve.api import MAX_DEPTH as API_MAX_DEPTH
from ajet.serve.api import build_api, compose
from ajet.task import Task
from ajet.task_sampler import MultiTaskSampler
from tests.scripted_engine import ScriptedEngine

SECRET = "fuzz-secret-0123456789abcdef"
PROXY_MAX_BODY_BYTES = 256 * 1024      # the test proxy's size limit (the default, 8 MiB, only costs time here)
CHECK_EVERY = 50                       # requests between two checks that the route's valid request succeeds
ROTATE_EVERY = 200                     # proxy requests per episode (its recorded calls are the prompt history)
LONG = "long " * 20_000                # 100,000 characters
REPLIES = ["ok", '<tool_call>\n{"name": "f", "arguments": {"x": "1"}}\n</tool_call>']
ALL_VALUES = os.environ.get("AJET_FUZZ_ALL_VALUES") == "1"

# ---- the valid request of each route -----------------------------------------------------------------------
PARAMS = {"type": "object", "properties": {"x": {"type": "string", "description": "an input"}}, "required": ["x"]}
CHAT = {"model": "m", "messages": [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": [{"type": "text", "text": "Call f."}], "name": "u"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"x": "1"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "2"},
    {"role": "user", "content": "Again."}],
    "tools": [{"type": "function", "function": {"name": "f", "description": "A function.", "parameters": PARAMS,
                                                "strict": True}}],
    "tool_choice": "auto", "parallel_tool_calls": True, "temperature": 0.7, "top_p": 0.9, "max_tokens": 8,
    "stop": ["\n\n\n"], "seed": 1, "n": 1, "logprobs": True, "top_logprobs": 2, "response_format": {"type": "text"},
    "user": "u", "metadata": {"k": "v"}, "store": False, "frequency_penalty": 0, "presence_penalty": 0}
CHAT_STREAM = {"model": "m", "messages": [{"role": "developer", "content": "Be terse."},
                                          {"role": "user", "content": "Call f."}],
               "tools": [{"type": "function", "function": {"name": "f", "parameters": PARAMS}}],
               "tool_choice": {"type": "function", "function": {"name": "f"}}, "stream": True,
               "stream_options": {"include_usage": True}, "n": 2, "max_completion_tokens": 8}
RESPONSES = {"model": "m", "instructions": "Be terse.", "input": [
    {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Call f."}]},
    {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Calling."}]},
    {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": '{"x": "1"}', "id": "fc_1"},
    {"type": "function_call_output", "call_id": "call_1", "output": "2"},
    {"type": "reasoning", "summary": []},
    {"type": "message", "role": "user", "content": "Again."}],
    "tools": [{"type": "function", "name": "f", "description": "A function.", "parameters": PARAMS, "strict": True},
              {"type": "web_search"}],
    "tool_choice": "auto", "parallel_tool_calls": True, "max_output_tokens": 8, "temperature": 0.7, "top_p": 0.9,
    "text": {"format": {"type": "text"}}, "store": False, "metadata": {"k": "v"}, "reasoning": {"effort": "low"},
    "include": ["reasoning.encrypted_content"], "truncation": "disabled", "user": "u", "stream": False}
RESPONSES_STREAM = {"model": "m", "input": "Call f.", "stream": True, "tool_choice": {"type": "function", "name": "f"},
                    "tools": [{"type": "function", "name": "f", "parameters": PARAMS}],
                    "text": {"format": {"type": "json_object"}}, "instructions": "Answer in json."}
MESSAGES = {"model": "m", "max_tokens": 8, "system": [{"type": "text", "text": "Be terse."}], "messages": [
    {"role": "user", "content": [{"type": "text", "text": "Call f."}]},
    {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "s"},
                                      {"type": "text", "text": "Calling."},
                                      {"type": "tool_use", "id": "tu_1", "name": "f", "input": {"x": "1"}}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "tu_1", "content": [{"type": "text",
                                                                                            "text": "2"}]},
                                 {"type": "text", "text": "Again."}]}],
    "tools": [{"name": "f", "description": "A function.", "input_schema": PARAMS},
              {"type": "web_search_20250305", "name": "web_search"}],
    "tool_choice": {"type": "auto", "disable_parallel_tool_use": True}, "stop_sequences": ["\n\n\n"],
    "temperature": 0.7, "top_p": 0.9, "stream": False, "metadata": {"user_id": "u"},
    "thinking": {"type": "disabled"}}
MESSAGES_STREAM = {"model": "m", "max_tokens": 8, "system": "Be terse.", "stream": True,
                   "messages": [{"role": "user", "content": "Call f."}],
                   "tools": [{"name": "f", "input_schema": PARAMS}], "tool_choice": {"type": "tool", "name": "f"}}
COUNT_TOKENS = {"model": "m", "system": "Be terse.", "messages": [{"role": "user", "content": "Call f."}],
                "tools": [{"name": "f", "input_schema": PARAMS}], "tool_choice": {"type": "any"}}
GEMINI = {"systemInstruction": {"role": "user", "parts": [{"text": "Be terse."}]}, "contents": [
    {"role": "user", "parts": [{"text": "Call f."}]},
    {"role": "model", "parts": [{"text": "hm", "thought": True}, {"text": "Calling."},
                                {"functionCall": {"id": "fc_1", "name": "f", "args": {"x": "1"}},
                                 "thoughtSignature": "c2ln"}]},
    {"role": "user", "parts": [{"functionResponse": {"id": "fc_1", "name": "f", "response": {"output": "2"}}},
                               {"text": "Again."}]}],
    "tools": [{"functionDeclarations": [
        {"name": "f", "description": "A function.", "parameters": {
            "type": "OBJECT", "properties": {"x": {"type": "STRING", "description": "an input"}}, "required": ["x"]}},
        {"name": "g", "parametersJsonSchema": PARAMS}]},
        {"googleSearch": {}}],
    "toolConfig": {"functionCallingConfig": {"mode": "ANY", "allowedFunctionNames": ["f"]}},
    "generationConfig": {"temperature": 0.7, "topP": 0.9, "topK": 40, "maxOutputTokens": 8,
                         "stopSequences": ["\n\n\n"], "candidateCount": 1, "seed": 1, "presencePenalty": 0,
                         "frequencyPenalty": 0, "responseMimeType": "text/plain",
                         "thinkingConfig": {"thinkingBudget": 0}, "responseModalities": ["TEXT"]},
    "safetySettings": [{"category": "HARM_CATEGORY_HARASSMENT", "threshold": "BLOCK_NONE"}],
    "labels": {"k": "v"}}
# the streamed and counted Gemini bodies are smaller: their fields are read by the same models as GEMINI's
GEMINI_SMALL = {"systemInstruction": "Be terse.", "contents": [{"parts": [{"text": "Call f."}]}],
                "tools": [{"functionDeclarations": [{"name": "f", "parameters": PARAMS}]}],
                "toolConfig": {"functionCallingConfig": {"mode": "auto"}}}
GEMINI_STREAM = {**GEMINI_SMALL, "generationConfig": {"maxOutputTokens": 8, "temperature": 0.5}}
GEMINI_COUNT = {"contents": [{"role": "user", "parts": [{"text": "Call f."}]}]}
GEMINI_COUNT_WRAPPED = {"generateContentRequest": {"model": "models/m", **GEMINI_SMALL}}
BEGIN = {"client_id": "fuzz", "task": {"query": "What is 1 + 1?", "answer": "2", "task_id": "t1",
                                       "metadata": {"k": ["v", 1]}}, "group_id": "G", "dataset": "train"}
FINISH = {"reward": 1.0, "final_answer": "2", "metadata": {"k": "v"}, "metrics": {"m": 0.5}}
FINISH_ERROR = {"error": "the agent crashed"}
ABORT = {"reason": "gave up"}


def _deep_list(levels: int) -> list:
    v: list = []
    for _ in range(max(levels, 1) - 1):
        v = [v]
    return v


def wrong_value_classes(path: tuple, max_depth: int) -> list[list[tuple[str, Any]]]:
    """The values substituted at `path`, by JSON type class (the deep list nests as far as the route's depth
    limit allows at this path)."""
    return [[("null", None)], [("true", True)], [("0", 0), ("-1", -1), ("2**70", 2**70)],
            [("1.5", 1.5), ("NaN", math.nan)], [('""', ""), ('"x"', "x"), ("long string", LONG)],
            [("[]", []), ("[null]", [None]), ("deep list", _deep_list(max_depth - len(path)))],
            [("{}", {}), ('{"a": 1}', {"a": 1})]]


def wrong_values(path: tuple, max_depth: int, pick: int) -> list[tuple[str, Any]]:
    """One value of each class for the `pick`-th path (every value with AJET_FUZZ_ALL_VALUES=1)."""
    classes = wrong_value_classes(path, max_depth)
    if ALL_VALUES:
        return [v for values in classes for v in values]
    return [values[pick % len(values)] for values in classes]


# ---- routes ------------------------------------------------------------------------------------------------
def _openai_shape(body: Any, status: int) -> bool:
    err = body.get("error") if isinstance(body, dict) else None
    return (isinstance(err, dict) and set(err) == {"message", "type", "param", "code"}
            and isinstance(err["message"], str) and bool(err["message"]))


def _anthropic_shape(body: Any, status: int) -> bool:
    return (isinstance(body, dict) and body.get("type") == "error" and isinstance(body.get("error"), dict)
            and isinstance(body["error"].get("type"), str) and isinstance(body["error"].get("message"), str)
            and bool(body["error"]["message"]))


def _google_shape(body: Any, status: int) -> bool:
    err = body.get("error") if isinstance(body, dict) else None
    return (isinstance(err, dict) and set(err) == {"code", "message", "status"} and err["code"] == status
            and isinstance(err["status"], str) and isinstance(err["message"], str) and bool(err["message"]))


# in-stream error events that mean "internal error" in each shape
_INTERNAL_EVENTS = ('"internal_error"', '"api_error"', '"INTERNAL"', '"server_error"')


@dataclass
class Route:
    """One fuzzed route: its name, its valid body, how to send a body (raw bytes -> response), the shape its
    errors have, its JSON depth limit and its body size limit. `offset` shifts which value of each class a
    path gets (routes that share a body get different ones)."""

    name: str
    valid: dict[str, Any]
    send: Callable[[bytes], httpx.Response]
    shape: Callable[[Any, int], bool]
    max_depth: int
    max_body: int
    after_ok: Callable[[httpx.Response], None] = lambda r: None   # a valid answer consumed state (an episode)
    offset: int = 0


# top-level field -> the field an error about a bad value in it names instead, as the two conflict: a penalty
# (both penalties are refused together), a renamed Gemini function (`allowedFunctionNames` names the old one),
# instructions without "json" (`text.format` json_object needs it), a finish without `error` (then `reward` is due)
CROSS = {"presence_penalty": "penalties", "tools": "allowedFunctionNames", "instructions": "text.format",
         "error": "reward"}


@dataclass
class Tally:
    """What the fuzz saw on one route: answers by status, and each problem found (a line per request)."""

    requests: int = 0
    by_status: dict[int, int] = field(default_factory=dict)
    server_errors: list[str] = field(default_factory=list)     # 5xx, dropped connections, internal error events
    bad_shapes: list[str] = field(default_factory=list)        # a 4xx not in the route's error shape
    unnamed: list[str] = field(default_factory=list)           # a 4xx for a substituted path that names no field
    dead: list[str] = field(default_factory=list)              # the valid request failed after bad ones

    def count(self, status: int) -> None:
        self.requests += 1
        self.by_status[status] = self.by_status.get(status, 0) + 1

    def summary(self) -> str:
        n4 = sum(n for s, n in self.by_status.items() if 400 <= s < 500)
        n5 = sum(n for s, n in self.by_status.items() if s >= 500)
        return f"{self.requests} requests: {self.by_status.get(200, 0)} 200, {n4} 4xx, {n5} 5xx"


def paths(value: Any, prefix: tuple = ()) -> Iterator[tuple]:
    """Every JSON path in `value` (the root `()` first), depth first."""
    yield prefix
    if isinstance(value, dict):
        for k, v in value.items():
            yield from paths(v, prefix + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from paths(v, prefix + (i,))


def substituted(body: Any, path: tuple, value: Any) -> Any:
    """A copy of `body` with the value at `path` replaced by `value`."""
    if not path:
        return value
    out = copy.deepcopy(body)
    target = out
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return out


def with_extra_key(body: Any, path: tuple) -> Any:
    """A copy of `body` whose object at `path` has one key more."""
    out = copy.deepcopy(body)
    target = out
    for key in path:
        target = target[key]
    target["zz_unknown_field"] = 1
    return out


def encode(body: Any) -> bytes:
    """`body` as JSON bytes (NaN written as `NaN`, as Python's parser reads it)."""
    return json.dumps(body, allow_nan=True).encode()


def cases(route: Route) -> Iterator[tuple[str, tuple | None, bytes]]:
    """(label, substituted path or None, raw body) of every request the fuzz sends to `route`."""
    base = route.valid
    for k, path in enumerate(paths(base)):
        for label, value in wrong_values(path, route.max_depth, k + route.offset):
            yield f"{'.'.join(map(str, path)) or '<body>'} = {label}", path, encode(substituted(base, path, value))
        target = base
        for key in path:
            target = target[key]
        if isinstance(target, dict):
            yield f"{'.'.join(map(str, path)) or '<body>'} + unknown key", path, encode(with_extra_key(base, path))
    valid = encode(base) if base else b'{"zz": ""}'
    first_string = valid.index(b'": "') + 4            # the first string value: bytes inserted into it
    first_key = next(iter(base), "zz")
    for label, raw in (("invalid UTF-8", valid[:first_string] + b"\xff\xfe\xfd" + valid[first_string:]),
                       ("lone surrogate bytes", valid[:first_string] + b"\xed\xa0\x80" + valid[first_string:]),
                       ("escaped lone surrogate", valid[:first_string] + b"\\udc80" + valid[first_string:]),
                       ("empty body", b""), ("truncated JSON", valid[: len(valid) // 2]), ("not JSON", b"hello"),
                       ("NUL bytes", b"\x00" * 64), ("single quotes", b"{'model': 'm'}"),
                       ("JSON list", b"[" + valid + b"]"), ("brackets past any limit", b"[" * 5000 + b"]" * 5000),
                       ("nested past the limit", encode(substituted(base, (first_key,),
                                                                    _deep_list(route.max_depth + 5)))),
                       ("huge integer literal", valid[:-1] + b', "zz": ' + b"9" * 5000 + b"}"),
                       ("duplicate keys", valid[:-1] + b', "' + first_key.encode() + b'": null}')):
        yield label, None, raw
    # at and just over the size limit: the first string value padded
    pad = route.max_body - len(valid)
    yield "body at the size limit", None, valid[:first_string] + b"a" * pad + valid[first_string:]
    yield "body over the size limit", None, valid[:first_string] + b"a" * (pad + 1) + valid[first_string:]


def fuzz(route: Route, tally: Tally) -> None:
    """Send every case of `route`; tally the answers; check the valid request every CHECK_EVERY requests and at
    the end."""
    def check_alive(after: str) -> None:
        try:
            r = route.send(encode(route.valid))
        except httpx.HTTPError as exc:
            tally.dead.append(f"{route.name} after {after}: {type(exc).__name__}: {exc}")
            return
        if r.status_code != 200 or any(e in r.text for e in _INTERNAL_EVENTS):
            tally.dead.append(f"{route.name} after {after}: {r.status_code} {r.text[:300]}")
        else:
            route.after_ok(r)

    label = "the start"
    for k, (label, path, raw) in enumerate(cases(route)):
        where = f"{route.name}: {label}"
        try:
            r = route.send(raw)
        except httpx.HTTPError as exc:                   # a dropped connection is a server error too
            tally.count(599)
            tally.server_errors.append(f"{where}: {type(exc).__name__}: {exc}")
            continue
        tally.count(r.status_code)
        if r.status_code >= 500:
            tally.server_errors.append(f"{where}: {r.status_code} {r.text[:300]}")
        elif r.status_code >= 400:
            try:
                body = r.json()
            except ValueError:
                body = None
            if not route.shape(body, r.status_code) or (label == "body over the size limit" and r.status_code != 413):
                tally.bad_shapes.append(f"{where}: {r.status_code} {r.text[:300]}")
            elif path is not None and r.status_code == 400 and not _names_the_field(body, path):
                tally.unnamed.append(f"{where}: {r.text[:300]}")
        else:
            if any(e in r.text for e in _INTERNAL_EVENTS):
                tally.server_errors.append(f"{where}: 200 with an internal error event: {r.text[-300:]}")
            route.after_ok(r)
        if k % CHECK_EVERY == CHECK_EVERY - 1:
            check_alive(label)
    check_alive(f"the last case ({label})")


def _names_the_field(body: dict, path: tuple) -> bool:
    """The error names the substituted field: its message or param holds a dotted prefix of `path` (at least
    its top-level field), or the field `CROSS` says it conflicts with. A prompt over the context (a long
    string) names no field, rightly."""
    text = body["error"]["message"] + " " + str(body["error"].get("param") or "")
    if not path or text.startswith("the prompt is"):
        return True
    prefixes = [".".join(map(str, path[:n])) for n in range(len(path), 0, -1)]
    return any(p in text for p in prefixes) or CROSS.get(str(path[0]), "\0") in text


# ---- the server ----------------------------------------------------------------------------------------------
@contextmanager
def serving(tokenizer) -> Iterator[tuple[ProxyServer, EpisodeQueue, httpx.Client]]:
    """The proxy over a scripted engine with the episode API mounted (as `ajet serve` composes them)."""
    proxy = ProxyServer(ScriptedEngine(tokenizer, REPLIES), tokenizer, SamplingParams(max_tokens=8),
                        max_body_bytes=PROXY_MAX_BODY_BYTES)
    queue = EpisodeQueue(MultiTaskSampler({"train": [Task(f"t{i}", f"What is {i} + 1?", str(i + 1))
                                                     for i in range(8)]}),
                         num_repeat=2, tasks_per_step=2, total_steps=1000, first_step=1, attempt=0,
                         record=lambda step, ep: None, idle_timeout_s=3600)
    queue.bind(proxy)
    proxy.app = compose(proxy.app, build_api(queue, SECRET), queue.activity)
    proxy.start()
    try:
        with httpx.Client(base_url=proxy.url, timeout=60) as http:
            yield proxy, queue, http
    finally:
        proxy.stop()


class Episodes:
    """The proxy episode the proxy routes post to, a new one every ROTATE_EVERY requests."""

    def __init__(self, proxy: ProxyServer):
        self.proxy, self.sent, self.ep = proxy, 0, proxy.open_episode("fuzz-0")

    def base(self) -> str:
        self.sent += 1
        if self.sent % ROTATE_EVERY == 0:
            self.proxy.close_episode(self.ep)
            self.ep = self.proxy.open_episode(f"fuzz-{self.sent}")
        return self.ep.base_url.removesuffix("/v1")


def proxy_routes(proxy: ProxyServer, http: httpx.Client) -> list[Route]:
    episodes = Episodes(proxy)
    json_headers = {"content-type": "application/json"}

    def poster(path: str) -> Callable[[bytes], httpx.Response]:
        return lambda raw: http.post(episodes.base() + path, content=raw, headers=json_headers)

    gemini = "/v1beta/models/gemini-fuzz"
    limit = PROXY_MAX_BODY_BYTES
    return [Route("chat", CHAT, poster("/v1/chat/completions"), _openai_shape, MAX_JSON_DEPTH, limit),
            Route("chat stream", CHAT_STREAM, poster("/v1/chat/completions"), _openai_shape, MAX_JSON_DEPTH, limit),
            Route("responses", RESPONSES, poster("/v1/responses"), _openai_shape, MAX_JSON_DEPTH, limit),
            Route("responses stream", RESPONSES_STREAM, poster("/v1/responses"), _openai_shape, MAX_JSON_DEPTH,
                  limit),
            Route("messages", MESSAGES, poster("/v1/messages"), _anthropic_shape, MAX_JSON_DEPTH, limit),
            Route("messages stream", MESSAGES_STREAM, poster("/v1/messages"), _anthropic_shape, MAX_JSON_DEPTH,
                  limit),
            Route("count_tokens", COUNT_TOKENS, poster("/v1/messages/count_tokens"), _anthropic_shape,
                  MAX_JSON_DEPTH, limit),
            Route("gemini generateContent", GEMINI, poster(gemini + ":generateContent"), _google_shape,
                  MAX_JSON_DEPTH, limit),
            Route("gemini streamGenerateContent", GEMINI_STREAM, poster(gemini + ":streamGenerateContent?alt=sse"),
                  _google_shape, MAX_JSON_DEPTH, limit),
            Route("gemini countTokens", GEMINI_COUNT, poster(gemini + ":countTokens"),
                  _google_shape, MAX_JSON_DEPTH, limit),
            Route("gemini countTokens (generateContentRequest)", GEMINI_COUNT_WRAPPED, poster(gemini + ":countTokens"),
                  _google_shape, MAX_JSON_DEPTH, limit)]


def episode_api_routes(http: httpx.Client) -> list[Route]:
    """begin, finish (with a reward, and with an error), abort, heartbeat: finish and abort end the episode they
    succeed on, so a new one is begun (in a group of its own) whenever the last one ended."""
    auth = {"authorization": f"Bearer {SECRET}", "content-type": "application/json"}
    groups = iter(range(10**9))
    live: list[dict[str, Any]] = []

    def begin_fresh() -> dict[str, Any]:
        body = {**BEGIN, "group_id": f"fuzz-{next(groups)}"}
        r = http.post("/ajet/v1/episodes", json=body, headers=auth)
        assert r.status_code == 200, r.text
        return r.json()

    def episode() -> dict[str, Any]:
        if not live:
            live.append(begin_fresh())
        return live[0]

    def on_episode(action: str) -> Callable[[bytes], httpx.Response]:
        def send(raw: bytes) -> httpx.Response:
            ep = episode()
            return http.post(f"/ajet/v1/episodes/{ep['episode_id']}/{action}", content=raw,
                             headers={**auth, TOKEN_HEADER: ep["episode_token"]})
        return send

    def ended(_r: httpx.Response) -> None:
        live.clear()

    def abort_begun(r: httpx.Response) -> None:     # keep the queue's places free: give a begun episode up
        ep = r.json()
        http.post(f"/ajet/v1/episodes/{ep['episode_id']}/abort", json={},
                  headers={**auth, TOKEN_HEADER: ep["episode_token"]}).raise_for_status()

    def begin(raw: bytes) -> httpx.Response:
        # a fresh group per request, unless the fuzz replaced the group id (a repeated id fills its group: 409)
        if raw.startswith(b"{") and b'"group_id": "G"' in raw:
            raw = raw.replace(b'"group_id": "G"', f'"group_id": "fuzz-{next(groups)}"'.encode(), 1)
        return http.post("/ajet/v1/episodes", content=raw, headers=auth)

    return [Route("episode begin", BEGIN, begin, _openai_shape, API_MAX_DEPTH, API_MAX_BODY_BYTES, abort_begun),
            Route("episode finish", FINISH, on_episode("finish"), _openai_shape, API_MAX_DEPTH, API_MAX_BODY_BYTES,
                  ended),
            Route("episode finish (error)", FINISH_ERROR, on_episode("finish"), _openai_shape, API_MAX_DEPTH,
                  API_MAX_BODY_BYTES, ended),
            Route("episode abort", ABORT, on_episode("abort"), _openai_shape, API_MAX_DEPTH, API_MAX_BODY_BYTES,
                  ended),
            Route("episode heartbeat", {}, on_episode("heartbeat"), _openai_shape, API_MAX_DEPTH,
                  API_MAX_BODY_BYTES)]


def run_fuzz(tokenizer, only: Callable[[str], bool] = lambda name: True) -> dict[str, Tally]:
    """Fuzz every route (those `only` keeps); returns the tally of each."""
    tallies: dict[str, Tally] = {}
    with serving(tokenizer) as (proxy, _queue, http):
        for k, route in enumerate(proxy_routes(proxy, http) + episode_api_routes(http)):
            route.offset = k
            if only(route.name):
                fuzz(route, tallies.setdefault(route.name, Tally()))
    return tallies


def _report(tallies: dict[str, Tally]) -> str:
    lines = [f"{name}: {t.summary()}" for name, t in tallies.items()]
    total = Tally()
    for t in tallies.values():
        total.requests += t.requests
        for s, n in t.by_status.items():
            total.by_status[s] = total.by_status.get(s, 0) + n
    return "\n".join(lines + [f"all routes: {total.summary()}"])


@pytest.mark.parametrize("group", ["proxy", "episode API"])
def test_no_request_gets_a_5xx_and_the_server_keeps_answering(tokenizer, group):
    t0 = time.monotonic()
    tallies = run_fuzz(tokenizer, lambda name: name.startswith("episode") == (group == "episode API"))
    report = _report(tallies)
    print(f"\n{report}\n({time.monotonic() - t0:.1f} s)")
    problems = {kind: [p for t in tallies.values() for p in getattr(t, kind)]
                for kind in ("server_errors", "dead", "bad_shapes", "unnamed")}
    assert not problems["server_errors"], f"{len(problems['server_errors'])} server errors:\n" + "\n".join(
        problems["server_errors"][:40]) + "\n" + report
    assert not problems["dead"], "the valid request failed:\n" + "\n".join(problems["dead"][:20])
    assert not problems["bad_shapes"], "4xx not in the route's error shape:\n" + "\n".join(problems["bad_shapes"][:20])
    assert not problems["unnamed"], "4xx naming no field:\n" + "\n".join(problems["unnamed"][:20])
    assert len(tallies) == (11 if group == "proxy" else 5) and all(t.requests >= 20 for t in tallies.values()), report


# the type confusions of Gemini's tools and toolConfig that were 500s, and the path each 400 names
GEMINI_CONFUSIONS = [({"tools": [{"functionDeclarations": "f"}]}, "tools.0.functionDeclarations"),
                     ({"tools": [{"functionDeclarations": 5}]}, "tools.0.functionDeclarations"),
                     ({"tools": [{"functionDeclarations": [None]}]}, "tools.0.functionDeclarations.0"),
                     ({"tools": [{"functionDeclarations": True}]}, "tools.0.functionDeclarations"),
                     ({"toolConfig": {"functionCallingConfig": "ANY"}}, "toolConfig.functionCallingConfig"),
                     ({"toolConfig": {"functionCallingConfig": {"mode": "ANY", "allowedFunctionNames": 5}}},
                      "toolConfig.functionCallingConfig.allowedFunctionNames"),
                     ({"toolConfig": {"functionCallingConfig": {"mode": "ANY", "allowedFunctionNames": {"a": 1}}}},
                      "toolConfig.functionCallingConfig.allowedFunctionNames"),
                     ({"toolConfig": {"functionCallingConfig": {"mode": "ANY", "allowedFunctionNames": ["g"]}}},
                      "toolConfig.functionCallingConfig.allowedFunctionNames.0")]


def test_gemini_type_confusions_are_400s_in_googles_shape_naming_the_field(tokenizer):
    """Each was a 500 (`TypeError` / `AttributeError` inside the adapter) on all three Gemini routes."""
    with serving(tokenizer) as (proxy, _queue, http):
        ep = proxy.open_episode("gemini")
        base = ep.gemini_base_url + "/v1beta/models/m"
        valid = {"contents": [{"parts": [{"text": "hi"}]}],
                 "tools": [{"functionDeclarations": [{"name": "f", "parameters": PARAMS}]}]}
        for change, where in GEMINI_CONFUSIONS:
            for action in (":generateContent", ":streamGenerateContent?alt=sse", ":countTokens"):
                r = http.post(base + action, json={**valid, **change})
                assert r.status_code == 400, (action, change, r.text[:300])
                err = r.json()["error"]
                assert err["code"] == 400 and err["status"] == "INVALID_ARGUMENT", err
                assert err["message"].startswith(where + ":"), (where, err["message"])
        r = http.post(base + ":generateContent", json=valid)       # still answers, and recorded only that call
        assert r.status_code == 200 and r.json()["candidates"][0]["content"]["role"] == "model", r.text[:300]
        assert len(proxy.close_episode(ep)) == 1


def test_bad_items_and_blocks_name_their_path_in_the_clients_terms(tokenizer):
    """A bad field inside a Responses input item or a Messages block is named where the client wrote it, not
    where it lands in the chat turn the adapter builds (`messages.2.assistant.tool_calls.0.function.name`)."""
    with serving(tokenizer) as (proxy, _queue, http):
        ep = proxy.open_episode("paths")
        call = {"type": "function_call", "call_id": "c1", "name": 5, "arguments": "{}"}
        r = http.post(ep.base_url + "/responses", json={"model": "m", "input": [
            {"role": "user", "content": "hi"}, {"type": "reasoning", "summary": []}, call]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "input.2.name", r.text[:300]
        use = {"type": "tool_use", "id": "t1", "name": "f", "input": "not an object"}
        r = http.post(ep.anthropic_base_url + "/v1/messages", json={"model": "m", "max_tokens": 5, "messages": [
            {"role": "user", "content": "hi"}, {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "hm", "signature": "s"}, use]}, {"role": "user", "content": "go"}]})
        assert r.status_code == 400 and r.json()["error"]["message"].startswith("messages.1.content.1.input:"), r.text
        r = http.post(ep.anthropic_base_url + "/v1/messages", json={"model": "m", "max_tokens": 5, "messages": [
            {"role": "user", "content": "hi"}], "tools": [{"name": "a:b", "input_schema": PARAMS}]})
        assert r.status_code == 400 and r.json()["error"]["message"].startswith("tools.0.name:"), r.text
        proxy.close_episode(ep)


def test_nan_in_an_episode_body_is_a_400_naming_the_field(tokenizer):
    """`json.loads` takes NaN and Infinity; a begin whose task metadata held one was begun, then its answer
    could not be rendered (a 500, and the episode stayed begun)."""
    with serving(tokenizer) as (_proxy, queue, http):
        auth = {"authorization": f"Bearer {SECRET}", "content-type": "application/json"}
        for literal in (b"NaN", b"Infinity", b"-Infinity"):
            body = b'{"task": {"query": "q", "metadata": {"k": [1, ' + literal + b']}}, "group_id": "G"}'
            r = http.post("/ajet/v1/episodes", content=body, headers=auth)
            assert r.status_code == 400, r.text[:300]
            err = r.json()["error"]
            assert err["code"] == "invalid_body" and "`task.metadata.k[1]`" in err["message"], err
        assert queue.status()["episodes"]["begun"] == 0
