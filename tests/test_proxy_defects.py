"""Proxy defects found in review (issue 9, items 13-15), each with the test that failed before the fix.

13: a request near the body limit is parsed, rendered and tokenized off the event loop (other episodes'
    calls keep their latency), and an over-long prompt is rejected before it is tokenized;
14: no 500 on a lone surrogate in an object key, on deep nesting anywhere, on an episode closed while its
    call runs; closing an episode twice is harmless;
15: `strict: true` tools are accepted and the generated arguments are checked against their schema.

A real uvicorn proxy on 127.0.0.1 with a scripted engine and the tiny model's real tokenizer.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import threading
import time

import httpx
import openai
import pytest

from ajet.episode import Episode
from ajet.llm_call import Completion, SamplingParams, TokenDelta
from ajet.proxy.server import MAX_JSON_DEPTH, ProxyServer
from ajet.task import Task
from ajet.trainer import _step_metrics
from tests.scripted_engine import ScriptedEngine
from tests.test_proxy_hardening import CALC_TOOL, assert_error, assert_ok, chat_url, running

USER = [{"role": "user", "content": "hi"}]


# ---- 13: the event loop keeps serving while a huge request is prepared --------------------------------
def _latencies_while(http, url: str, work) -> list[float]:
    """Seconds per chat call to `url`, made one after another while `work()` runs in a thread."""
    thread = threading.Thread(target=work)
    thread.start()
    latencies, deadline = [], time.monotonic() + 120
    while thread.is_alive() and time.monotonic() < deadline:
        t = time.perf_counter()
        assert_ok(http.post(url, json={"model": "m", "messages": USER}))
        latencies.append(time.perf_counter() - t)
    thread.join()
    return latencies


def test_a_7mib_request_does_not_stall_other_episodes(tokenizer):
    """Another episode's calls, made while 7 MiB requests are parsed, validated, rendered and found too
    long, keep a p99 latency below 0.55x the time one 7 MiB request takes. Measured on the idle 2-core
    machine: p99 17 ms vs 49 ms per 7 MiB request (0.35x); with the preparation moved back onto the event
    loop (the mutation this test exists for) p99 36-41 ms vs 45-53 ms (0.78x), and before the length bound
    the loop tokenized for tens of seconds. With the GIL the prepare thread's single orjson call still
    delays the loop by ~15 ms, so the bound is relative, not "p99 ~ median". A measurement disturbed by other processes is taken again (at most 3
    times); an event loop that does the work itself fails every time."""
    words = " ".join(f"w{i % 997}" for i in range(1_450_000))            # ~7 MiB of text
    big = json.dumps({"model": "m", "messages": [{"role": "user", "content": words}]}).encode()
    assert 6.5 * 2**20 < len(big) < 7.5 * 2**20
    with running(tokenizer, max_model_len=4096) as (proxy, _, ep, http):
        url = chat_url(proxy.open_episode("other"))
        for _ in range(20):                                                # warm up
            assert_ok(http.post(url, json={"model": "m", "messages": USER}))
        seen = []
        for _attempt in range(3):
            answers: list[httpx.Response] = []
            big_s: list[float] = []

            def send_big():   # three times, so that enough small calls overlap them for a p99
                with httpx.Client(timeout=120) as h:
                    for _ in range(3):
                        t = time.perf_counter()
                        answers.append(h.post(chat_url(ep), content=big))
                        big_s.append(time.perf_counter() - t)

            latencies = _latencies_while(http, url, send_big)
            for r in answers:
                assert_error(r, 400, "context_length_exceeded")
            assert len(latencies) >= 20, latencies                          # the loop served calls meanwhile
            p99 = sorted(latencies)[int(0.99 * (len(latencies) - 1))]
            seen.append((round(p99, 4), round(statistics.median(big_s), 4), len(latencies)))
            if p99 <= 0.55 * statistics.median(big_s):
                return
    pytest.fail(f"p99 of the small calls above 0.55x one 7 MiB request's time in every attempt "
                f"(p99 s, 7 MiB request s, calls): {seen}")


def test_a_small_body_is_prepared_on_the_event_loop_and_a_larger_one_in_the_pool(tokenizer):
    """A body of at most INLINE_PREPARE_BYTES is prepared on the event loop's thread (no hop to the pool and
    back); one byte more goes to a prepare thread. Both answer the same."""
    from ajet.proxy.server import INLINE_PREPARE_BYTES

    with running(tokenizer, replies=("ok",) * 4) as (proxy, _, ep, http):
        threads: list[str] = []
        prepare = proxy._prepare
        proxy._prepare = lambda *a: threads.append(threading.current_thread().name) or prepare(*a)
        small = json.dumps({"model": "m", "messages": USER}).encode()
        for size in (len(small), INLINE_PREPARE_BYTES, INLINE_PREPARE_BYTES + 1):
            body = small[:-1] + b" " * (size - len(small)) + b"}"      # JSON whitespace pads it to `size` bytes
            assert len(body) == size
            r = http.post(chat_url(ep), content=body, headers={"Content-Type": "application/json"})
            assert_ok(r)
            assert r.json()["choices"][0]["message"]["content"] == "ok"
        assert threads[0] == threads[1] == "ajet-proxy" and threads[2].startswith("ajet-prepare"), threads


def test_an_over_long_prompt_is_rejected_before_it_is_tokenized(tokenizer):
    """The rendered text's length bounds its token count from below: 7 MiB cannot fit 4,096 tokens, so
    the 400 comes without tokenizing it; a prompt the bound cannot rule out is tokenized, then rejected."""
    with running(tokenizer, max_model_len=4096) as (proxy, _, ep, http):
        encoded: list[int] = []
        encode = proxy.prompts.encode
        proxy.prompts.encode = lambda text: encoded.append(len(text)) or encode(text)
        r = http.post(chat_url(ep), json={"model": "m", "messages": [{"role": "user", "content": "x " * 3_500_000}]})
        err = assert_error(r, 400, "context_length_exceeded", "messages")
        assert "at least" in err["message"] and encoded == []
        # ~6,000 tokens of text: the bound (chars / longest token) allows it, the tokenizer does not
        r = http.post(chat_url(ep), json={"model": "m", "messages": [{"role": "user", "content": "ab " * 6000}]})
        assert_error(r, 400, "context_length_exceeded", "messages")
        assert encoded and "at least" not in r.json()["error"]["message"]
        assert proxy.prompts.min_tokens("ab " * 6000) <= len(encode("ab " * 6000))


# ---- 14: no 500 ---------------------------------------------------------------------------------------
def test_lone_surrogate_in_an_object_key_is_a_400(tokenizer):
    with running(tokenizer) as (_, _, ep, http):
        raw = b'{"model": "m", "messages": [{"role": "user", "content": "x", "k\\udc00y": 1}]}'
        err = assert_error(http.post(chat_url(ep), content=raw), 400, "invalid_value")
        assert err["param"] == "messages.0.k\\udc00y" and "surrogate" in err["message"]


def _nested(depth: int) -> str:
    """JSON text of a value nested `depth` levels (arrays and objects alternating)."""
    return "".join("[" if k % 2 else '{"a": ' for k in range(depth)) + '"x"' + "".join(
        "]" if k % 2 else "}" for k in reversed(range(depth)))


def _tool_turns(arguments: str) -> str:
    return ('[{"role": "user", "content": "x"}, {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", '
            '"type": "function", "function": {"name": "calculate", "arguments": ' + arguments + '}}]}, '
            '{"role": "tool", "tool_call_id": "c1", "content": "2"}]')


@pytest.mark.parametrize("padded", [False, True], ids=["small body", "body over 16 KiB"])
@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH - 10, MAX_JSON_DEPTH + 1, 900, 5000])
def test_deep_nesting_anywhere_is_answered_or_a_400_never_a_500(tokenizer, depth, padded):
    """Messages, tool parameters and tool-call arguments (as an object, and as a JSON string) nested
    `depth` levels: within the limit they are answered; deeper, a 400 names where (a JSON string of
    arguments is text to the proxy: always answered). Also in a body over 16 KiB (20 KB of `user` text), which the
    proxy walks without counting its brackets first."""
    deep, user, calc = _nested(depth), json.dumps(USER), json.dumps([CALC_TOOL])
    tool = ('[{"type": "function", "function": {"name": "calculate", "parameters": {"type": "object", "properties": '
            '{"expression": {"type": "string", "default": ' + deep + '}}}}}]')
    cases = {"message": '"messages": [{"role": "user", "content": "x", "extra": ' + deep + "}]",
             "tool parameters": f'"messages": {user}, "tools": {tool}',
             "arguments object": f'"messages": {_tool_turns(deep)}, "tools": {calc}',
             "arguments string": f'"messages": {_tool_turns(json.dumps(deep))}, "tools": {calc}'}
    with running(tokenizer, max_model_len=10**5) as (_, _, ep, http):
        for name, body in cases.items():
            pad = '"user": "' + "u" * 20_000 + '", ' if padded else ""
            r = http.post(chat_url(ep), content='{"model": "m", ' + pad + body + "}")
            if depth < MAX_JSON_DEPTH or name == "arguments string":
                assert r.status_code == 200, (name, r.text[:300])
            else:
                assert_error(r, 400, "invalid_json" if depth > 1000 else "invalid_value")


def test_deeply_nested_generated_arguments_are_answered(tokenizer):
    """The model itself writes a tool call nested 5,000 deep: it stays text, the answer is a 200."""
    reply = '<tool_call>\n{"name": "calculate", "arguments": ' + "[" * 5000 + "]" * 5000 + "}\n</tool_call>"
    with running(tokenizer, replies=[reply]) as (proxy, _, ep, http):
        r = http.post(chat_url(ep), json={"model": "m", "messages": USER, "tools": [CALC_TOOL]})
        assert_ok(r)
        assert r.json()["choices"][0]["message"]["content"].startswith("<tool_call>")


class _HangingEngine(ScriptedEngine):
    """Announces two tokens, then waits until cancelled (an agent still running when its episode is closed)."""

    def __init__(self, tokenizer):
        super().__init__(tokenizer, ["never"])
        self.started = threading.Event()
        self.cancelled = threading.Event()

    async def generate(self, prompt_ids, params: SamplingParams, on_tokens=None) -> Completion:
        ids = self.tokenizer.encode("hello there", add_special_tokens=False)[:2]
        if on_tokens is not None:
            on_tokens(TokenDelta(ids, [-0.5] * len(ids)))
        self.started.set()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        return Completion(ids, [-0.5] * len(ids), "stop", 0)


@pytest.mark.parametrize("stream", [False, True])
def test_episode_closed_while_its_call_runs_gets_an_openai_error(tokenizer, stream):
    """Non-streaming: a 404 `episode_closed` body; streaming: the chunks sent so far, then an error event
    (never a bare 500 or a cut stream). The generation is cancelled, nothing is recorded, and closing the
    episode again is harmless."""
    engine = _HangingEngine(tokenizer)
    proxy = ProxyServer(engine, tokenizer, SamplingParams(max_tokens=16)).start()
    try:
        ep = proxy.open_episode("ep")
        out: dict = {}

        def call():
            with httpx.Client(timeout=60) as h:
                body = {"model": "m", "messages": USER, "stream": stream}
                with h.stream("POST", chat_url(ep), json=body) as r:
                    out["status"], out["text"] = r.status_code, r.read().decode()

        thread = threading.Thread(target=call)
        thread.start()
        assert engine.started.wait(30)
        time.sleep(0.2)                                   # the stream's first chunks are out
        assert proxy.close_episode(ep) == []
        thread.join(30)
        assert engine.cancelled.wait(10)
        assert proxy.close_episode(ep) == []              # twice: harmless
    finally:
        proxy.stop()
    if not stream:
        assert out["status"] == 404
        assert json.loads(out["text"])["error"]["code"] == "episode_closed"
    else:
        assert out["status"] == 200
        events = [line[6:] for line in out["text"].splitlines() if line.startswith("data: ")]
        assert json.loads(events[0])["object"] == "chat.completion.chunk" and "[DONE]" not in events
        assert json.loads(events[-1])["error"]["code"] == "episode_closed"


def test_close_episode_twice_returns_the_calls_once(tokenizer):
    with running(tokenizer) as (proxy, _, ep, http):
        assert_ok(http.post(chat_url(ep), json={"model": "m", "messages": USER}))
        assert len(proxy.close_episode(ep)) == 1
        assert proxy.close_episode(ep) == []
        assert_error(http.post(chat_url(ep), json={"model": "m", "messages": USER}), 404, "episode_not_found")


# ---- 15: strict tools ---------------------------------------------------------------------------------
STRICT_CALC = {"type": "function", "function": {**CALC_TOOL["function"], "strict": True, "parameters": {
    **CALC_TOOL["function"]["parameters"], "additionalProperties": False}}}


def _call(args: str) -> str:
    return '<tool_call>\n{"name": "calculate", "arguments": ' + args + "}\n</tool_call>"


def test_strict_tool_arguments_are_validated_and_violations_recorded_and_counted(tokenizer):
    """The OpenAI SDK's `strict: true` tools are accepted; arguments that break the schema are answered as
    generated (the proxy does not constrain decoding), recorded on the call and counted per step."""
    replies = [_call('{"expression": "1+1"}'), _call('{"expr": 2}'), _call('{"expression": 3}'), _call('{"expr": 2}')]
    with running(tokenizer, replies=replies) as (proxy, _, ep, _http):
        client = openai.OpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=0)
        args = []
        for tools in ([STRICT_CALC], [STRICT_CALC], [STRICT_CALC], [CALC_TOOL]):
            r = client.chat.completions.create(model="m", messages=USER, tools=tools)
            args.append(json.loads(r.choices[0].message.tool_calls[0].function.arguments))
        calls = proxy.close_episode(ep)
    assert args == [{"expression": "1+1"}, {"expr": 2}, {"expression": 3}, {"expr": 2}]   # answered as generated
    assert calls[0].strict_violations == []
    assert calls[1].strict_violations == ["calculate: 'expression' is a required property"]
    assert calls[2].strict_violations == ["calculate: 3 is not of type 'string' (at expression)"]
    assert calls[3].strict_violations == []                       # not strict: the schema is a hint
    episode = Episode("ep", Task("t", {}), "g", 0, calls=calls, reward=1.0)
    assert _step_metrics([episode], 1.0, 0)["rollout/strict_violations"] == 2


def test_strict_tool_with_an_invalid_schema_is_a_400(tokenizer):
    bad = {"type": "function", "function": {"name": "f", "strict": True,
                                            "parameters": {"type": "object", "properties": {"a": {"type": 5}}}}}
    with running(tokenizer) as (_, _, ep, http):
        err = assert_error(http.post(chat_url(ep), json={"model": "m", "messages": USER, "tools": [bad]}),
                           400, "invalid_value", "tools")
        assert "'f'" in err["message"] and "strict" in err["message"]
