"""The rest of the Chat Completions surface against the real server: token streaming from the real tiny
model, n > 1, top_logprobs, stop strings, and client retries that must not record a second call."""

import asyncio
import json

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ajet.engines.in_process import HFEngine
from ajet.llm_call import SamplingParams, TokenDelta
from ajet.proxy.server import ProxyServer
from ajet.tracker import merge_calls
from tests.scripted_engine import ScriptedEngine

USER = [{"role": "user", "content": "Tell me a story about numbers."}]


@pytest.fixture(scope="module")
def model_proxy(tiny_model_dir):
    """The proxy over the real tiny model's batched engine; the client's sampling params are honoured."""
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    engine = HFEngine(model, [tok.eos_token_id], tok.pad_token_id, max_model_len=512, decode_fn=tok.decode,
                      batch_wait_s=0.0)
    proxy = ProxyServer(engine, tok, SamplingParams(temperature=1.0, max_tokens=32), sampling_policy="client",
                        max_model_len=512).start()
    yield proxy, tok
    proxy.stop()
    engine.close()


def test_seeded_stream_and_non_stream_record_identical_tokens_and_text(model_proxy):
    proxy, _ = model_proxy
    ep = proxy.open_episode("seeded")
    client = openai.OpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=0)
    kw = dict(model="m", messages=USER, seed=1234, temperature=1.0, max_tokens=24, logprobs=True, top_logprobs=3)
    plain = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True))
    a, b = proxy.close_episode(ep)
    assert a.completion_ids == b.completion_ids and len(a.completion_ids) > 4
    assert a.completion_logprobs == pytest.approx(b.completion_logprobs, abs=1e-5)
    content = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(content) > 1                                    # tokens arrived as they were sampled
    assert "".join(content) == plain.choices[0].message.content == a.response_message["content"]
    streamed_lp = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed_lp] == [e.token for e in plain.choices[0].logprobs.content]
    assert [e.logprob for e in streamed_lp] == pytest.approx([e.logprob for e in plain.choices[0].logprobs.content])
    for e in plain.choices[0].logprobs.content:                # the sampled token is never likelier than top-1
        assert len(e.top_logprobs) == 3 and e.logprob <= e.top_logprobs[0].logprob + 1e-6
        assert e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob >= e.top_logprobs[2].logprob


def test_n_choices_are_recorded_apart_and_the_next_call_extends_the_chosen_one(model_proxy):
    proxy, tok = model_proxy
    ep = proxy.open_episode("n3")
    client = openai.OpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=0)
    r = client.chat.completions.create(model="m", messages=USER, n=3, seed=7, max_tokens=12)
    assert [c.index for c in r.choices] == [0, 1, 2]
    picked = r.choices[1].message
    client.chat.completions.create(model="m", max_tokens=8, messages=USER + [
        {"role": "assistant", "content": picked.content}, {"role": "user", "content": "Go on."}])
    calls = proxy.close_episode(ep)
    assert len(calls) == 4 and len({tuple(c.completion_ids) for c in calls[:3]}) == 3   # seeds 7, 8, 9
    assert [c.sampling.seed for c in calls[:3]] == [7, 8, 9]
    assert r.usage.completion_tokens == sum(len(c.completion_ids) for c in calls[:3])
    assert calls[3].prompt_parent == calls[1].call_id       # token-in-token-out continues choice 1
    assert calls[3].prompt_ids[:len(calls[1].prompt_ids) + len(calls[1].completion_ids)] == \
        calls[1].prompt_ids + calls[1].completion_ids
    samples = merge_calls(calls, "g")
    assert len(samples) == 3                                # choices 0 and 2 end their own branch


def test_n_choices_stream_with_their_index(model_proxy):
    proxy, _ = model_proxy
    ep = proxy.open_episode("n2-stream")
    client = openai.OpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=0)
    chunks = list(client.chat.completions.create(model="m", messages=USER, n=2, seed=3, max_tokens=10, stream=True))
    calls = proxy.close_episode(ep)
    text = {0: "", 1: ""}
    finish = {}
    for c in chunks:
        for ch in c.choices:
            text[ch.index] += ch.delta.content or ""
            if ch.finish_reason:
                finish[ch.index] = ch.finish_reason
    assert set(finish) == {0, 1}
    assert [text[0], text[1]] == [calls[0].response_message["content"], calls[1].response_message["content"]]


def test_stop_string_is_cut_from_the_answer_but_its_tokens_are_recorded(tokenizer):
    engine = ScriptedEngine(tokenizer, ["The result is 6. DONE and more"])
    proxy = ProxyServer(engine, tokenizer, SamplingParams(max_tokens=64)).start()
    try:
        ep = proxy.open_episode("stop")
        client = openai.OpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=0)
        plain = client.chat.completions.create(model="m", messages=USER, stop=["DONE"])
        streamed = "".join(c.choices[0].delta.content or "" for c in
                           client.chat.completions.create(model="m", messages=USER, stop="DONE", stream=True)
                           if c.choices)
        calls = proxy.close_episode(ep)
    finally:
        proxy.stop()
    # the scripted engine ignores stop strings and ends with end-of-turn, so the cut is the proxy's alone
    assert plain.choices[0].message.content == streamed == "The result is 6. "
    assert calls[0].completion_ids == engine.sampled[0] and calls[0].sampling.stop == ("DONE",)


class SlowFirstCall(ScriptedEngine):
    """The first generation takes `delay_s` seconds: longer than the client's timeout, so the SDK retries (the
    proxy stops a generation whose client left: a cancelled one is not counted, and the retry's is fast)."""

    def __init__(self, tokenizer, replies, delay_s):
        super().__init__(tokenizer, replies)
        self.delay_s, self.slowed = delay_s, False

    async def generate(self, prompt_ids, params, on_tokens=None):
        if not self.slowed:
            self.slowed = True
            await asyncio.sleep(self.delay_s)
        return await super().generate(prompt_ids, params, on_tokens)


@pytest.mark.parametrize("stream", [False, True])
def test_sdk_retry_after_a_timeout_records_one_call_and_no_fork(tokenizer, stream):
    engine = SlowFirstCall(tokenizer, ["first answer", "second answer"], delay_s=1.5)
    proxy = ProxyServer(engine, tokenizer, SamplingParams(max_tokens=64)).start()
    try:
        ep = proxy.open_episode("retry")
        client = openai.OpenAI(base_url=ep.base_url, api_key=ep.api_key, timeout=0.6, max_retries=4)

        def ask(messages):
            if not stream:
                return client.chat.completions.create(model="m", messages=messages).choices[0].message.content
            return "".join(c.choices[0].delta.content or "" for c in
                           client.chat.completions.create(model="m", messages=messages, stream=True) if c.choices)

        first = ask(USER)                       # attempt 0 times out (its generation stopped); a retry answers
        second = ask(USER + [{"role": "assistant", "content": first}, {"role": "user", "content": "more"}])
        calls = proxy.close_episode(ep)
    finally:
        proxy.stop()
    assert (first, second) == ("first answer", "second answer")
    assert len(engine.prompts) == 2 and len(calls) == 2
    assert calls[1].prompt_parent == calls[0].call_id
    assert len(merge_calls(calls, "g")) == 1


def test_identical_requests_without_a_retry_header_are_two_calls(tokenizer):
    """An agent may sample the same prompt twice on purpose (self-consistency): only a retry is deduplicated."""
    engine = ScriptedEngine(tokenizer, ["a", "b"])
    proxy = ProxyServer(engine, tokenizer, SamplingParams(max_tokens=64)).start()
    try:
        ep = proxy.open_episode("twice")
        body = {"model": "m", "messages": USER}
        with httpx.Client(timeout=10) as http:
            r1 = http.post(ep.base_url + "/chat/completions", json=body)
            r2 = http.post(ep.base_url + "/chat/completions", json=body)
            r3 = http.post(ep.base_url + "/chat/completions", json=body, headers={"x-stainless-retry-count": "1"})
            r4 = http.post(ep.base_url + "/chat/completions", json=body, headers={"Idempotency-Key": "k1"})
            r5 = http.post(ep.base_url + "/chat/completions", json=body, headers={"Idempotency-Key": "k1"})
        calls = proxy.close_episode(ep)
    finally:
        proxy.stop()
    texts = [r.json()["choices"][0]["message"]["content"] for r in (r1, r2, r3, r4, r5)]
    assert texts == ["a", "b", "b", "a", "a"]                 # r3 replays r2; r5 replays r4
    assert r3.json()["id"] == r2.json()["id"] and r5.json()["id"] == r4.json()["id"]
    assert len(calls) == 3


def test_a_failed_first_attempt_is_generated_again_on_retry(tokenizer):
    from tests.scripted_engine import FailingEngine
    engine = FailingEngine(tokenizer, ["recovered"])
    engine.fail_next = 1
    proxy = ProxyServer(engine, tokenizer, SamplingParams(max_tokens=64), retry_after_s=0).start()
    try:
        ep = proxy.open_episode("flaky")
        client = openai.OpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=2)
        r = client.chat.completions.create(model="m", messages=USER)
        calls = proxy.close_episode(ep)
    finally:
        proxy.stop()
    assert r.choices[0].message.content == "recovered" and len(calls) == 1


def test_streamed_tool_call_and_content_match_the_non_streamed_message(tokenizer):
    reply = 'Let me compute.\n<tool_call>\n{"name": "calculate", "arguments": {"expression": "2*3"}}\n</tool_call>'
    engine = ScriptedEngine(tokenizer, [reply])
    proxy = ProxyServer(engine, tokenizer, SamplingParams(max_tokens=64)).start()
    tool = {"type": "function", "function": {"name": "calculate", "parameters": {
        "type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}
    try:
        ep = proxy.open_episode("stream-tool")
        client = openai.OpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=0)
        chunks = list(client.chat.completions.create(model="m", messages=USER, tools=[tool], stream=True))
        calls = proxy.close_episode(ep)
    finally:
        proxy.stop()
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    content = [d.content for d in deltas if d.content]
    assert len(content) > 1 and "".join(content) == calls[0].response_message["content"] == "Let me compute."
    assert not any("<tool" in c for c in content)             # the tag never leaks into the content
    args = "".join(t.function.arguments or "" for d in deltas if d.tool_calls for t in d.tool_calls)
    assert json.loads(args) == {"expression": "2*3"}
    assert [d.tool_calls[0].id for d in deltas if d.tool_calls][0] == calls[0].response_message["tool_calls"][0]["id"]


def test_parallel_tool_calls_false_ends_generation_at_the_first_call(tokenizer):
    two = "".join(f'<tool_call>\n{{"name": "calculate", "arguments": {{"expression": "{e}"}}}}\n</tool_call>\n'
                  for e in ("1+1", "2+2"))
    engine = ScriptedEngine(tokenizer, [two])
    proxy = ProxyServer(engine, tokenizer, SamplingParams(max_tokens=128)).start()
    tool = {"type": "function", "function": {"name": "calculate", "parameters": {
        "type": "object", "properties": {"expression": {"type": "string"}}}}}
    try:
        ep = proxy.open_episode("one-call")
        client = openai.OpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=0)
        one = client.chat.completions.create(model="m", messages=USER, tools=[tool], parallel_tool_calls=False)
        both = client.chat.completions.create(model="m", messages=USER, tools=[tool])
        calls = proxy.close_episode(ep)
    finally:
        proxy.stop()
    assert [json.loads(t.function.arguments) for t in one.choices[0].message.tool_calls] == [{"expression": "1+1"}]
    assert len(both.choices[0].message.tool_calls) == 2
    assert calls[0].sampling.stop == ("</tool_call>",) and calls[1].sampling.stop == ()


def test_response_format_json_object_needs_json_in_the_messages_and_json_schema_is_refused(tokenizer):
    proxy = ProxyServer(ScriptedEngine(tokenizer, ['{"a": 1}']), tokenizer, SamplingParams(max_tokens=16)).start()
    try:
        ep = proxy.open_episode("fmt")
        url = ep.base_url + "/chat/completions"
        with httpx.Client(timeout=10) as http:
            r = http.post(url, json={"model": "m", "messages": USER, "response_format": {"type": "json_object"}})
            assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
            r = http.post(url, json={"model": "m", "response_format": {"type": "json_object"},
                                     "messages": [{"role": "user", "content": [{"type": "text", "text": "Reply in JSON"}]}]})
            assert r.status_code == 200 and json.loads(r.json()["choices"][0]["message"]["content"]) == {"a": 1}
            r = http.post(url, json={"model": "m", "messages": USER, "response_format": {
                "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}})
            assert r.status_code == 400 and r.json()["error"]["param"] == "response_format.type"
        proxy.close_episode(ep)
    finally:
        proxy.stop()


class FailsMidStream(ScriptedEngine):
    """Announces two tokens, then the engine dies."""

    async def generate(self, prompt_ids, params, on_tokens=None):
        ids = self.tokenizer.encode("Partial answer here", add_special_tokens=False)
        for t in ids[:2]:
            on_tokens(TokenDelta([t], [-0.5]))
            await asyncio.sleep(0)
        raise RuntimeError("CUDA error: an illegal memory access was encountered")


def test_engine_failure_mid_stream_ends_with_an_error_event_and_records_nothing(tokenizer):
    proxy = ProxyServer(FailsMidStream(tokenizer, ["unused"]), tokenizer, SamplingParams(max_tokens=16)).start()
    try:
        ep = proxy.open_episode("dies")
        with httpx.Client(timeout=10) as http:
            r = http.post(ep.base_url + "/chat/completions", json={"model": "m", "messages": USER, "stream": True})
        calls = proxy.close_episode(ep)
    finally:
        proxy.stop()
    assert r.status_code == 200                    # the stream had started
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e.get("choices"))
    assert events[-1]["error"]["code"] == "engine_error" and "[DONE]" not in r.text
    assert calls == []


def test_engine_failure_before_the_first_token_keeps_its_status_when_streaming(tokenizer):
    from tests.scripted_engine import FailingEngine
    engine = FailingEngine(tokenizer, ["fine"])
    engine.fail_next = 1
    proxy = ProxyServer(engine, tokenizer, SamplingParams(max_tokens=16)).start()
    try:
        ep = proxy.open_episode("dies-early")
        with httpx.Client(timeout=10) as http:
            body = {"model": "m", "messages": USER, "stream": True}
            first = http.post(ep.base_url + "/chat/completions", json=body)
            second = http.post(ep.base_url + "/chat/completions", json=body)
        calls = proxy.close_episode(ep)
    finally:
        proxy.stop()
    assert first.status_code == 503 and first.json()["error"]["code"] == "engine_error"
    assert first.headers["retry-after"] == "1"
    assert second.status_code == 200 and "data: [DONE]" in second.text and len(calls) == 1


def test_the_first_start_freezes_the_objects_alive_then(tokenizer, monkeypatch):
    """The objects alive when the process's first proxy starts (libraries, model, tokenizer) move to the garbage
    collector's permanent generation (`gc.freeze`), so that the full collections the proxy's per-call garbage
    triggers no longer walk them; objects made later stay collectable, and a later start freezes nothing more."""
    import gc

    from ajet.proxy import server

    monkeypatch.setattr(server, "_HEAP_FROZEN", False)     # as in a process whose proxy starts for the first time
    thresholds = gc.get_threshold()
    gc.set_threshold(700, 11, 12)                          # CPython's young threshold; older ones of its own
    before = [object()]
    proxy = ProxyServer(ScriptedEngine(tokenizer, ["a"]), tokenizer, SamplingParams(max_tokens=8)).start()
    between = [object()]
    gc.set_threshold(500, 11, 12)
    again = ProxyServer(ScriptedEngine(tokenizer, ["a"]), tokenizer, SamplingParams(max_tokens=8)).start()
    try:
        collectable = {id(o) for o in gc.get_objects()}    # every generation but the permanent one
        assert id(before) not in collectable and id(between) in collectable
        assert gc.get_threshold() == (500, 11, 12)         # the first start raised the young one; the later left it
    finally:
        gc.set_threshold(*thresholds)
        proxy.stop()
        again.stop()


def test_the_first_start_raises_the_young_collection_threshold_only(tokenizer, monkeypatch):
    """The first start raises the young generation's threshold to YOUNG_GC_THRESHOLD and keeps the older ones; a
    process that turned collection off (threshold 0) keeps it off."""
    import gc

    from ajet.proxy import server

    thresholds = gc.get_threshold()
    try:
        for given, expected in (((700, 11, 12), (server.YOUNG_GC_THRESHOLD, 11, 12)), ((0, 11, 12), (0, 11, 12)),
                                ((9000, 10, 10), (9000, 10, 10))):
            monkeypatch.setattr(server, "_HEAP_FROZEN", False)
            gc.set_threshold(*given)
            server.freeze_heap_once()
            assert gc.get_threshold() == expected, given
    finally:
        gc.set_threshold(*thresholds)
