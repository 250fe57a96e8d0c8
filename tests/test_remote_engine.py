"""RemoteEngine against a real vLLM-format server (benchmarks/instant_engine_server.py: uvicorn on 127.0.0.1 in
its own process), with both HTTP clients; and the proxy over a RemoteEngine, driven by the real OpenAI SDK."""

import asyncio
import socket

import openai
import pytest
from transformers import AutoTokenizer

from ajet.llm_call import SamplingParams
from ajet.proxy.server import ProxyServer
from ajet.remote_engine import RemoteEngine
from benchmarks.instant_engine_server import InstantServer, token_logprob

CLIENTS = ["aiohttp", "httpx"]
MAX_MODEL_LEN = 512


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def reply_ids(tokenizer) -> list[int]:
    return tokenizer.encode("The answer is 42.", add_special_tokens=False) + [tokenizer.eos_token_id]


@pytest.fixture(scope="module")
def server(tokenizer, reply_ids):
    pieces = [tokenizer.decode([t]) for t in reply_ids[:-1]] + [""]
    server = InstantServer.start(reply_ids, pieces, max_model_len=MAX_MODEL_LEN)
    yield server
    server.stop()


def run(coro):
    """Run `coro` in a fresh event loop, bounded to 10 s."""
    return asyncio.run(asyncio.wait_for(coro, 10))


async def generate(engine: RemoteEngine, prompt_ids, params, stream: bool):
    """(completion, the deltas on_tokens received, whether each arrived on this loop); closes the engine."""
    loop = asyncio.get_running_loop()
    deltas, on_loop = [], []

    def on_tokens(delta):
        deltas.append(delta)
        on_loop.append(asyncio.get_running_loop() is loop)

    try:
        return await engine.generate(prompt_ids, params, on_tokens if stream else None), deltas, on_loop
    finally:
        await engine.aclose()


@pytest.mark.parametrize("client", CLIENTS)
def test_stream_and_non_stream_return_the_exact_ids_and_logprobs(server, reply_ids, client):
    prompt = [5, 6, 7]
    engine = RemoteEngine(server.url + "/v1", "policy", client=client)
    engine.policy_version = 3
    plain, _, _ = run(generate(engine, prompt, SamplingParams(max_tokens=64), stream=False))
    streamed, deltas, on_loop = run(generate(engine, prompt, SamplingParams(max_tokens=64), stream=True))
    for c in (plain, streamed):
        assert c.token_ids == reply_ids                      # EOS included, last
        assert c.logprobs == [token_logprob(i) for i in range(len(reply_ids))]
        assert c.finish_reason == "stop" and c.policy_version == 3 and c.top_logprobs is None
    assert deltas and all(on_loop)
    assert [t for d in deltas for t in d.token_ids] == streamed.token_ids
    assert [lp for d in deltas for lp in d.logprobs] == streamed.logprobs
    assert all(d.top_logprobs is None for d in deltas)


@pytest.mark.parametrize("client", CLIENTS)
@pytest.mark.parametrize("stream", [False, True])
def test_max_tokens_cut_and_top_logprobs_most_likely_first(server, reply_ids, client, stream):
    engine = RemoteEngine(server.url + "/v1", "policy", client=client)
    c, deltas, _ = run(generate(engine, [1, 2], SamplingParams(max_tokens=3, top_logprobs=2), stream))
    assert c.token_ids == reply_ids[:3] and c.finish_reason == "length"
    # the server lists the sampled token and 2 alternatives, the first more likely than the sampled one
    assert c.top_logprobs == [[(t + 1, -0.05), (t, token_logprob(i))] for i, t in enumerate(reply_ids[:3])]
    if stream:
        assert [top for d in deltas for top in d.top_logprobs] == c.top_logprobs


@pytest.mark.parametrize("client", CLIENTS)
def test_sampling_params_are_sent_as_vllm_expects(server, client):
    engine = RemoteEngine(server.url + "/v1", "policy", client=client)
    params = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=5, seed=11, stop=("\n\n", "END"))
    run(generate(engine, [9, 8, 7], params, stream=False))
    assert server.stats()["last_request"] == {
        "model": "policy", "prompt": [9, 8, 7], "max_tokens": 5, "temperature": 0.7, "top_p": 0.9,
        "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0, "seed": 11, "stop": ["\n\n", "END"],
        "logprobs": 1, "return_tokens_as_token_ids": True, "skip_special_tokens": False, "stream": False}
    run(generate(engine, [9], SamplingParams(max_tokens=5, top_logprobs=3), stream=True))
    body = server.stats()["last_request"]
    assert body["stream"] is True and body["logprobs"] == 3 and body["seed"] is None and body["stop"] == []


@pytest.mark.parametrize("client", CLIENTS)
@pytest.mark.parametrize("stream", [False, True])
def test_context_length_400_is_a_value_error(server, client, stream):
    engine = RemoteEngine(server.url + "/v1", "policy", client=client)
    with pytest.raises(ValueError, match="maximum context length is 512"):
        run(generate(engine, [1] * MAX_MODEL_LEN, SamplingParams(max_tokens=16), stream))


@pytest.mark.parametrize("client", CLIENTS)
def test_server_errors_and_refused_connections_are_runtime_errors(server, client):
    failing = RemoteEngine(server.url + "/v1", "error-500", client=client)
    with pytest.raises(RuntimeError, match="HTTP 500: scripted failure"):
        run(generate(failing, [1, 2], SamplingParams(max_tokens=8), stream=False))
    with pytest.raises(RuntimeError, match="HTTP 500"):
        run(generate(failing, [1, 2], SamplingParams(max_tokens=8), stream=True))
    broken = RemoteEngine(server.url + "/v1", "error-stream", client=client)
    with pytest.raises(RuntimeError, match="scripted failure mid-stream"):
        run(generate(broken, [1, 2], SamplingParams(max_tokens=8), stream=True))
    with socket.socket() as s:                    # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    refused = RemoteEngine(f"http://127.0.0.1:{port}/v1", "policy", client=client)
    with pytest.raises(RuntimeError, match=f"127.0.0.1:{port}"):
        run(generate(refused, [1, 2], SamplingParams(max_tokens=8), stream=False))


@pytest.mark.parametrize("stream", [False, True])
def test_proxy_over_remote_engine_keeps_token_in_token_out(server, tokenizer, reply_ids, stream):
    engine = RemoteEngine(server.url + "/v1", "policy")
    proxy = ProxyServer(engine, tokenizer, SamplingParams(max_tokens=64)).start()
    try:
        ep = proxy.open_episode("ep-remote")
        client = openai.OpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=0)
        messages = [{"role": "user", "content": "What is 6 * 7?"}]
        for _ in range(2):
            r = client.chat.completions.create(model="policy", messages=messages, stream=stream)
            content = "".join(c.choices[0].delta.content or "" for c in r if c.choices) if stream \
                else r.choices[0].message.content
            assert content == tokenizer.decode(reply_ids, skip_special_tokens=True)
            messages += [{"role": "assistant", "content": content}, {"role": "user", "content": "And doubled?"}]
        calls = proxy.close_episode(ep)
        asyncio.run(engine.aclose())              # closes the session living on the proxy's loop
    finally:
        proxy.stop()
    first, second = calls
    assert first.completion_ids == second.completion_ids == reply_ids
    assert first.completion_logprobs == [token_logprob(i) for i in range(len(reply_ids))]
    assert second.prompt_parent == first.call_id
    assert second.prompt_ids[:len(first.prompt_ids) + len(reply_ids)] == first.prompt_ids + first.completion_ids
    assert len(second.prompt_ids) > len(first.prompt_ids) + len(reply_ids)   # + the new user turn
