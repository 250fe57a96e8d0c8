"""The run-mode interface (ajet/rollout/__init__.py) and the one episode record (`LLMCall.from_dict`): fast checks
with no model loaded."""

from __future__ import annotations

import json

import pytest

from ajet.config import AjetConfig
from ajet.episode import Episode
from ajet.errors import ConfigError
from ajet.llm_call import LLMCall, SamplingParams
from ajet.task import Task
from ajet.trainer import run


def _call(**extra) -> LLMCall:
    return LLMCall(call_id="c0", episode_id="e0", agent_tag="default", index=0,
                   messages=[{"role": "user", "content": "2+2?"}], tools=None, prompt_ids=[1, 2, 3],
                   completion_ids=[4, 5], completion_logprobs=[-0.25, -1.5], finish_reason="stop",
                   response_message={"role": "assistant", "content": "4"},
                   sampling=SamplingParams(temperature=0.7, max_tokens=9, seed=11, stop=("\n\n",)), policy_version=3,
                   **extra)


def test_a_call_read_back_from_json_equals_the_recorded_one():
    call = _call(prompt_parent="c-1", token_versions=[3, 4])
    back = LLMCall.from_dict(json.loads(json.dumps(call.to_dict())))   # JSON turns the stop tuple into a list
    assert back == call
    assert back.sampling.stop == ("\n\n",)                               # hashable again, as recorded


def test_a_record_from_another_version_reads_without_its_unknown_keys():
    d = _call().to_dict()
    d["cache_hit_tokens"] = 7                   # a field a newer ajet writes
    d["sampling"]["min_p"] = 0.05
    del d["api"], d["timings"]                  # fields an older one did not write
    back = LLMCall.from_dict(d)
    assert (back.api, back.timings, back.sampling.temperature) == ("chat", {}, 0.7)
    with pytest.raises(TypeError):              # a required field missing is still an error
        LLMCall.from_dict({k: v for k, v in d.items() if k != "prompt_ids"})


def test_an_episode_round_trips_through_its_record():
    ep = Episode("e0", Task(task_id="t", query="2+2?", answer="4"), "g0", 1, calls=[_call()], reward=1.0,
                 duration_s=0.5, attempt=2)
    back = Episode.from_dict(json.loads(json.dumps({**ep.to_dict(), "attempt": 2})))
    assert back.calls == ep.calls and (back.episode_id, back.group_id, back.repeat_index, back.reward,
                                       back.attempt) == ("e0", "g0", 1, 1.0, 2)


def test_the_default_mode_refuses_an_sft_config_by_name(tmp_path):
    """`ajet.trainer.run(cfg)` runs the workflow in process; a config with an `sft:` section would otherwise train
    generated episodes with the SFT objective: refused, naming the command, before any model loads."""
    (tmp_path / "tasks.jsonl").write_text('{"task_id": "t", "query": "q"}\n')
    cfg = AjetConfig(workflow="no_such_module:W", data={"train_path": str(tmp_path / "tasks.jsonl")},
                     model={"path": str(tmp_path / "no-model")}, sft={"from_dir": str(tmp_path / "old")},
                     trainer={"exp_dir": str(tmp_path / "exp"), "progress": False})
    with pytest.raises(ConfigError, match="ajet sft"):
        run(cfg)
    assert not (tmp_path / "exp").exists()      # nothing written
