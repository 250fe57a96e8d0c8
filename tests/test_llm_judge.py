"""The LLM judge: robust score parsing, a real OpenAI-compatible endpoint (ajet's proxy), the default frozen
initial policy (the tiny model), and an unparseable judgement recorded instead of crashing."""

import asyncio
import textwrap

import pytest

from ajet.config import load_config
from ajet.judges import load_judge
from ajet.judges.llm import LLMJudge, parse_score
from ajet.llm_call import SamplingParams
from ajet.model import load_tokenizer
from ajet.proxy.server import ProxyServer
from ajet.task import Task
from ajet.workflow import WorkflowOutput
from tests.scripted_engine import ScriptedEngine


@pytest.mark.parametrize("reply, score", [
    ("Score: 7", 0.7), ("The answer is right.\nscore = 9.5", 0.95), ("I'd give it 3/5.", 0.6),
    ("**8**", 0.8), ("Rating: 12", 1.0), ("score: -2", 0.0), ("4 out of 10", 0.4),
    ("Score: 2 ... on reflection, Score: 6", 0.6), ("Yes, it asks for the date.", 1.0), ("no.", 0.0),
])
def test_parse_score(reply, score):
    assert parse_score(reply, 10) == pytest.approx(score)


@pytest.mark.parametrize("reply", ["", None, "It is good.", "there is no number here", "Nothing asked."])
def test_parse_score_failure_is_none(reply):
    assert parse_score(reply, 10) is None


def _cfg(tmp_path, tiny_model_dir, judge_section: str):
    (tmp_path / "rubric.txt").write_text("Q: {query}\nRef: {reference}\nA: {answer}\nScore 0-{max_score}.")
    (tmp_path / "conf.yaml").write_text(textwrap.dedent(f"""
        workflow: wf.py:W
        judge: ajet.judges.llm:LLMJudge
        model: {{path: "{tiny_model_dir}", max_model_len: 512}}
        data: {{train_path: t.jsonl}}
    """) + judge_section)
    return load_config(tmp_path / "conf.yaml")


def test_llm_judge_over_an_openai_compatible_endpoint(tmp_path, tiny_model_dir):
    tok = load_tokenizer(tiny_model_dir)
    engine = ScriptedEngine(tok, ["Fairly good. Score: 8", "I cannot decide."])
    proxy = ProxyServer(engine, tok, SamplingParams(max_tokens=32)).start()
    try:
        ep = proxy.open_episode("judge-endpoint")
        cfg = _cfg(tmp_path, tiny_model_dir, f"llm_judge: {{base_url: '{ep.base_url}', api_key: '{ep.api_key}', "
                                             f"rubric: rubric.txt}}\n")
        judge = load_judge(cfg)
        assert isinstance(judge, LLMJudge)
        task = Task("t", "What is 2+2?", "4")
        good, bad = WorkflowOutput(final_answer="4"), WorkflowOutput(final_answer="5")
        assert asyncio.run(judge(task, good)) == pytest.approx(0.8)
        assert good.metadata["llm_judge"] == {"reply": "Fairly good. Score: 8", "score": 0.8}
        assert good.metrics["judge_parse_failed"] == 0.0
        assert asyncio.run(judge(task, bad)) == 0.0                   # unparseable: recorded, not crashed
        assert bad.metadata["llm_judge"]["parse_error"] and bad.metrics["judge_parse_failed"] == 1.0
        sent = tok.decode(engine.prompts[0])
        assert "Q: What is 2+2?\nRef: 4\nA: 4\nScore 0-10." in sent    # the rubric file, filled in
    finally:
        proxy.stop()


def test_default_judge_is_the_frozen_initial_policy(tmp_path, tiny_model_dir):
    cfg = _cfg(tmp_path, tiny_model_dir, "llm_judge: {max_tokens: 12}\n")
    judge = load_judge(cfg)
    outs = [WorkflowOutput(final_answer=f"answer {i}") for i in range(3)]

    async def judge_all():
        return await asyncio.gather(*(judge(Task(f"t{i}", "Say hi.", "hi"), o) for i, o in enumerate(outs)))

    rewards = asyncio.run(judge_all())
    # the tiny random model writes no score: every judgement is a recorded parse failure, reward 0, no crash
    assert rewards == [0.0, 0.0, 0.0]
    assert all(o.metadata["llm_judge"]["parse_error"] and o.metrics["judge_parse_failed"] == 1.0 for o in outs)
    assert all(isinstance(o.metadata["llm_judge"]["reply"], str) for o in outs)
    frozen = judge._frozen
    assert frozen is not None and frozen.engine.generated_tokens > 0          # it really generated
    assert not any(p.requires_grad for p in frozen.engine.model.parameters())  # and is never trained
    greedy = [WorkflowOutput(final_answer="same") for _ in range(2)]
    for o in greedy:
        asyncio.run(judge(Task("t", "Say hi.", "hi"), o))
    assert greedy[0].metadata["llm_judge"]["reply"] == greedy[1].metadata["llm_judge"]["reply"]   # greedy
