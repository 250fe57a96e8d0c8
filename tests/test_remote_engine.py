"""RemoteEngine against a real vLLM-format server (benchmarks/instant_engine_server.py: uvicorn on 127.0.0.1 in
its own process), with both HTTP clients; and the proxy over a RemoteEngine, driven by the real OpenAI SDK."""

import asyncio

import openai
import pytest
import torch

from ajet.llm_call import SamplingParams
from ajet.proxy.server import ProxyServer
from ajet.engines.remote import RemoteEngine
from ajet.sampling_dist import processed_logprobs
from benchmarks.instant_engine_server import InstantServer, raw_distribution, token_logprob
from tests.local_servers import free_port

CLIENTS = ["aiohttp", "httpx"]
MAX_MODEL_LEN = 512


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
    # the server lists the sampled token (the most likely) and the next alternative
    assert c.top_logprobs == [[(t, token_logprob(i)), (t + 1, pytest.approx(raw_distribution(i)[1]))]
                              for i, t in enumerate(reply_ids[:3])]
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
    port = free_port()                            # a port nobody listens on
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


def _scripted_logits(i: int, token: int) -> torch.Tensor:
    """The instant server's raw distribution at reply position i as logits over ids 0..token+20 `[V]`."""
    logits = torch.full((token + 21,), float("-inf"))
    logits[token:] = torch.tensor(raw_distribution(i))
    return logits


@pytest.mark.parametrize("stream", [False, True])
def test_logprobs_are_the_processed_distribution_the_trainer_scores(server, reply_ids, stream):
    """The server mimics vLLM's `--logprobs-mode processed_logprobs`; RemoteEngine hands its numbers over, and
    they equal ajet.sampling_dist.processed_logprobs (temperature, then nucleus, renormalised) of the same logits."""
    engine = RemoteEngine(server.url + "/v1", "policy")
    c, _, _ = run(generate(engine, [3, 4], SamplingParams(temperature=0.7, top_p=0.97, max_tokens=4, top_logprobs=5),
                           stream))
    for i, (t, lp, tops) in enumerate(zip(c.token_ids, c.logprobs, c.top_logprobs)):
        want = processed_logprobs(_scripted_logits(i, t), torch.tensor(0.7), torch.tensor(0.97))
        assert lp == pytest.approx(want[t].item(), abs=1e-6) and lp > token_logprob(i)   # not the raw value
        kept = [(tid, v) for tid, v in tops if v > -9999]
        assert 1 <= len(kept) < 5                              # the nucleus cut the alternatives off
        assert kept == [(tid, pytest.approx(want[tid].item(), abs=1e-6)) for tid, _ in kept]
        assert all(v == -9999.0 and want[tid].item() == float("-inf") for tid, v in tops[len(kept):])


def test_a_server_reporting_raw_logprobs_is_refused_with_the_flag_to_set(tokenizer, reply_ids):
    pieces = [tokenizer.decode([t]) for t in reply_ids[:-1]] + [""]
    raw = InstantServer.start(reply_ids, pieces, logprobs_mode="raw_logprobs")
    try:
        with pytest.raises(RuntimeError, match="--logprobs-mode processed_logprobs"):
            run(generate(RemoteEngine(raw.url + "/v1", "policy"), [1, 2], SamplingParams(max_tokens=4), False))
        unchecked = RemoteEngine(raw.url + "/v1", "policy", check_logprobs_mode=False)
        c, _, _ = run(generate(unchecked, [1, 2], SamplingParams(temperature=0.5, max_tokens=4), False))
        assert c.logprobs == [token_logprob(i) for i in range(4)]          # raw: temperature ignored
        before = raw.stats()["completions"]
        run(generate(RemoteEngine(raw.url + "/v1", "policy", check_logprobs_mode=False), [1], SamplingParams(), False))
        assert raw.stats()["completions"] == before + 1                    # no probe when unchecked
    finally:
        raw.stop()


def test_the_mode_is_probed_once_per_engine(server):
    engine = RemoteEngine(server.url + "/v1", "policy")

    async def three():
        try:
            for _ in range(3):
                await engine.generate([1, 2], SamplingParams(max_tokens=2))
        finally:
            await engine.aclose()

    before = server.stats()["completions"]
    run(three())
    assert server.stats()["completions"] == before + 4                     # 1 probe + 3 completions


@pytest.mark.parametrize("stream", [False, True])
def test_an_empty_stop_string_is_dropped_not_a_one_token_completion(server, reply_ids, stream):
    engine = RemoteEngine(server.url + "/v1", "policy")
    c, _, _ = run(generate(engine, [1, 2], SamplingParams(max_tokens=64, stop=("", "zzz")), stream))
    assert c.token_ids == reply_ids and c.finish_reason == "stop"
    assert server.stats()["last_request"]["stop"] == ["zzz"]


def test_proxy_over_remote_engine_ignores_an_empty_stop_string(server, tokenizer, reply_ids):
    engine = RemoteEngine(server.url + "/v1", "policy")
    proxy = ProxyServer(engine, tokenizer, SamplingParams(max_tokens=64)).start()
    try:
        ep = proxy.open_episode("ep-empty-stop")
        client = openai.OpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=0)
        r = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}], stop=[""])
        assert r.choices[0].message.content == tokenizer.decode(reply_ids, skip_special_tokens=True)
        (call,) = proxy.close_episode(ep)
        asyncio.run(engine.aclose())
    finally:
        proxy.stop()
    assert call.completion_ids == reply_ids and call.sampling.stop == ()
