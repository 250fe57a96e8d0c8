"""Training tokens and update time: one sample per call (naive) vs ajet's merged samples.

Episodes of 3, 20 and 50 turns with a system+task prompt, model replies and tool results of realistic
length (defaults 400 / 80 / 150 tokens). Calls are built as the proxy records them with token-in-token-
out prompts (each call's prompt = the previous call's prompt + its reply + the tool result); the
context tracker merges them. The update is the debug backbone's real gradient pass
(`DebugBackbone.accumulate_gradients`) on a small random Llama, timed for both sample sets.

    python benchmarks/merge_speedup.py [--turns 3 20 50] [--hidden 128] [--layers 2]
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from ajet.backbones.debug.backbone import DebugBackbone  # noqa: E402
from ajet.config import AjetConfig  # noqa: E402
from ajet.llm_call import LLMCall, SamplingParams  # noqa: E402
from ajet.tracker import Sample, merge_calls  # noqa: E402


def episode_calls(turns: int, prompt_len: int, reply_len: int, tool_len: int, vocab: int, rng: random.Random):
    """The recorded calls of one `turns`-call episode."""
    def toks(n):
        return [rng.randrange(3, vocab) for _ in range(n)]

    calls, prompt = [], toks(prompt_len)
    for i in range(turns):
        reply = toks(reply_len)
        calls.append(LLMCall(call_id=f"c{i}", episode_id="ep", agent_tag="default", index=i, messages=[], tools=None,
                             prompt_ids=list(prompt), completion_ids=reply, completion_logprobs=[-1.0] * reply_len,
                             finish_reason="stop", response_message={}, sampling=SamplingParams(), policy_version=0))
        prompt = prompt + reply + toks(tool_len)
    return calls


def naive_samples(calls: list[LLMCall]) -> list[Sample]:
    """One sample per call: what a tracker without merging trains on."""
    return [Sample(episode_id=c.episode_id, group_id="g", agent_tag=c.agent_tag, call_ids=[c.call_id],
                   prompt_ids=c.prompt_ids, response_ids=c.completion_ids, loss_mask=[1] * len(c.completion_ids),
                   old_logprobs=c.completion_logprobs, policy_versions=[0] * len(c.completion_ids)) for c in calls]


def timed_update(backbone: DebugBackbone, samples: list[Sample], repeats: int) -> float:
    for s in samples:
        s.advantage = 1.0
    backbone.accumulate_gradients(samples)  # warm-up
    best = float("inf")
    for _ in range(repeats):
        backbone.model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        backbone.accumulate_gradients(samples)
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turns", type=int, nargs="+", default=[3, 20, 50])
    ap.add_argument("--prompt-len", type=int, default=400)
    ap.add_argument("--reply-len", type=int, default=80)
    ap.add_argument("--tool-len", type=int, default=150)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()

    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models

    vocab = 4096
    with tempfile.TemporaryDirectory() as d:
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                                     num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=4,
                                     max_position_embeddings=32768)).save_pretrained(d)
        tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"<pad>": 0, "<eos>": 1}, "<pad>")),
                                      eos_token="<eos>", pad_token="<pad>")
        tok.chat_template = "{{ '' }}"
        tok.save_pretrained(d)
        cfg = AjetConfig(workflow="x:y", data={"train_path": "x"}, model={"path": d, "device": "cpu", "max_model_len": 32768},
                         algorithm={"micro_batch_tokens": 32768})
        backbone = DebugBackbone(cfg)
        print(f"model: random Llama hidden={args.hidden} layers={args.layers} vocab={vocab}; prompt/reply/tool = "
              f"{args.prompt_len}/{args.reply_len}/{args.tool_len} tokens; threads={torch.get_num_threads()}")
        print(f"{'turns':>5} {'naive tok':>10} {'merged tok':>10} {'tok ratio':>9} {'naive s':>8} {'merged s':>8} "
              f"{'time ratio':>10}")
        for turns in args.turns:
            calls = episode_calls(turns, args.prompt_len, args.reply_len, args.tool_len, vocab, random.Random(turns))
            naive, merged = naive_samples(calls), merge_calls(calls, "g")
            assert len(merged) == 1 and merged[0].num_loss_tokens == turns * args.reply_len
            n_tok = sum(len(s.input_ids) for s in naive)
            m_tok = sum(len(s.input_ids) for s in merged)
            t_naive = timed_update(backbone, naive, args.repeats)
            t_merged = timed_update(backbone, merged, args.repeats)
            print(f"{turns:>5} {n_tok:>10} {m_tok:>10} {n_tok / m_tok:>9.2f} {t_naive:>8.2f} {t_merged:>8.2f} "
                  f"{t_naive / t_merged:>10.2f}")
        backbone.close()


if __name__ == "__main__":
    main()
