"""ServerPool over two real vLLM-format servers (benchmarks/instant_engine_server.py, own processes): the
proxy's multi-turn episodes stay on one server each, new conversations go to the least-loaded one."""

import asyncio

import openai
import pytest
from transformers import AutoTokenizer

from ajet.engines.pool import ServerPool
from ajet.llm_call import SamplingParams
from ajet.proxy.server import ProxyServer
from ajet.engines.remote import RemoteEngine
from benchmarks.instant_engine_server import InstantServer


@pytest.fixture(scope="module")
def two_servers(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    reply = tok.encode("The answer is 42.", add_special_tokens=False) + [tok.eos_token_id]
    servers = [InstantServer.start(reply, [tok.decode([t]) for t in reply[:-1]] + [""]) for _ in range(2)]
    yield tok, servers
    for s in servers:
        s.stop()


class Recording(RemoteEngine):
    """A RemoteEngine that remembers the prompts it sent."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.prompts = []

    async def generate(self, prompt_ids, params, on_tokens=None):
        self.prompts.append(list(prompt_ids))
        return await super().generate(prompt_ids, params, on_tokens)


def test_episodes_are_sticky_and_spread_over_servers(two_servers):
    tok, servers = two_servers
    pool = ServerPool([Recording(s.url + "/v1", "policy") for s in servers], affinity_tokens=16)
    pool.policy_version = 4
    assert all(e.policy_version == 4 for e in pool.engines)
    proxy = ProxyServer(pool, tok, SamplingParams(max_tokens=8)).start()
    before = [s.stats()["completions"] for s in servers]     # InstantServer.start's readiness probes count too

    async def episode(i: int) -> list[int]:
        ep = proxy.open_episode(f"e{i}")
        client = openai.AsyncOpenAI(base_url=ep.base_url, api_key=ep.api_key)
        messages = [{"role": "system", "content": f"Task {i}: answer briefly."}, {"role": "user", "content": "2+2?"}]
        for turn in range(3):    # each call extends the last: the same opening tokens
            r = await client.chat.completions.create(model="policy", messages=messages)
            messages += [{"role": "assistant", "content": r.choices[0].message.content},
                         {"role": "user", "content": f"and {turn}?"}]
        await client.close()
        calls = proxy.close_episode(ep)
        assert len(calls) == 3 and all(c.policy_version == 4 for c in calls)
        return [next(j for j, e in enumerate(pool.engines) if list(c.prompt_ids) in e.prompts) for c in calls]

    async def main():
        try:
            return await asyncio.gather(*(episode(i) for i in range(6)))
        finally:
            await pool.aclose()

    try:
        per_episode = asyncio.run(asyncio.wait_for(main(), 60))
    finally:
        proxy.stop()
    assert all(len(set(c)) == 1 for c in per_episode)                      # sticky per episode
    assert {c[0] for c in per_episode} == {0, 1}                            # both servers used
    # every call went through the pool, and both servers served several episodes' calls
    assert sum(len(e.prompts) for e in pool.engines) == 18
    assert all(s.stats()["completions"] - b >= len(e.prompts) for s, b, e in zip(servers, before, pool.engines))
    assert min(len(e.prompts) for e in pool.engines) >= 3


def test_least_loaded_server_takes_a_new_conversation():
    class Stub:
        policy_version = 0

    pool = ServerPool([Stub(), Stub(), Stub()], affinity_tokens=2)
    pool.in_flight = [3, 1, 2]
    assert pool.server_for([9, 9, 1]) == 1 and pool.server_for([9, 9, 5, 6]) == 1   # same opening: sticky
    pool.in_flight = [0, 5, 5]
    assert pool.server_for([7, 7]) == 0 and pool.server_for([9, 9]) == 1
    with pytest.raises(ValueError):
        ServerPool([])
