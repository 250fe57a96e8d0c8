"""TRL's GRPOTrainer doing the main job's work; run by benchmarks/vs_trl.py inside the TRL environment.

    .trl-venv/bin/python benchmarks/trl_grpo_job.py --model DIR --tasks FILE --steps N --out metrics.jsonl \
        [--temperature T] [--lr LR] [--micro-batch 16] [--bf16] [--gradient-checkpointing]

Configured as the main job (tutorial/example_math_agent/math_agent.yaml): the same converted SmolLM2 weights and
tokenizer (with ajet's tool chat template), the same tasks in the same order (4 per step, no shuffling), the same
system prompt and `calculate` tool (rendered by the same template, so the first turn's prompt text is the one ajet
renders, without the tool-call opening ajet's proxy forces: TRL has no such option), group 4 (`num_generations`),
48 tokens per turn, the main job's temperature and lr (vs_trl.py passes them), fp32 on the CPU, loss "grpo", no KL
(`beta=0`: TRL loads no reference model), one PPO epoch per generation batch (no old-logprob forward), the step's
16 sequences generated as one batch and trained in micro-batches of `--micro-batch` with gradient accumulation; the
tool runs in TRL's own tool loop (one round of tool calls, then the answer turn), and the reward is the main job's
(`math_agent_reward`).

Each step appends one JSON line to `--out`: wall seconds (step_s), generation seconds (rollout_s: TRL's
`_generate`, tools included), update seconds (the rest), generated tokens (the sampled ones: the completion less
the tool results TRL splices into it), forwarded tokens (prompt + completion of every sequence in the update),
padded tokens (the positions those forwards run), trained tokens (completion tokens under the loss mask), episodes
and model calls (assistant messages), and the process's peak RSS so far.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))                              # ajet's sources (the template, the reward, the tool)
sys.path.insert(0, str(ROOT / "tutorial" / "example_math_agent"))


async def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression with + - * / and parentheses, written with the numbers the question gives.

    Args:
        expression: the arithmetic expression to evaluate.

    Returns:
        The value as text, or an error message.
    """
    from math_workflow import calculate_tool      # the main job's tool (the sandbox, awaited)
    return await calculate_tool(json.dumps({"expression": expression}))


def zeroed() -> dict:
    """One step's figures, zero (the generated tokens are the trained ones: the sampled tokens)."""
    return {"rollout_s": 0.0, "forwarded": 0, "padded": 0, "trained": 0, "episodes": 0, "calls": 0}


def _arguments(tool_call: dict) -> str:
    """The JSON arguments of one of TRL's assistant tool calls (TRL may hold them as a dict)."""
    arguments = (tool_call.get("function") or {}).get("arguments") or {}
    return arguments if isinstance(arguments, str) else json.dumps(arguments)


MICRO_BATCH = 16                # sequences per forward/backward unless --micro-batch says otherwise
EPISODES_PER_STEP = 16          # 4 tasks x group 4, one generation batch per optimizer step


def parser() -> argparse.ArgumentParser:
    """The job's command line (shared with benchmarks/trl_profile.py)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--tasks", required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--temperature", type=float, default=0.6, help="the main job's rollout.temperature")
    ap.add_argument("--lr", type=float, default=3e-5, help="the main job's algorithm.lr")
    ap.add_argument("--micro-batch", type=int, default=MICRO_BATCH,
                    help=f"sequences per forward/backward (per_device_train_batch_size); the step's "
                         f"{EPISODES_PER_STEP} are accumulated over {EPISODES_PER_STEP}/N micro-batches "
                         f"(gradient_accumulation_steps), still one generation batch and one optimizer step per step")
    ap.add_argument("--bf16", action="store_true", help="bf16 autocast (TRL's default; fp32 without it, as ajet)")
    ap.add_argument("--gradient-checkpointing", action="store_true", help="TRL's default (off without it, as ajet)")
    return ap


def accumulation_steps(micro_batch: int) -> int:
    """Micro-batches per step for `micro_batch` sequences each; ValueError unless it divides the step's 16."""
    if micro_batch < 1 or EPISODES_PER_STEP % micro_batch:
        raise ValueError(f"--micro-batch {micro_batch} must divide the step's {EPISODES_PER_STEP} sequences "
                         f"(1, 2, 4, 8 or 16)")
    return EPISODES_PER_STEP // micro_batch


def parse_args(ap: argparse.ArgumentParser) -> argparse.Namespace:
    """`ap`'s arguments; a --micro-batch that does not divide the step is a one-line usage error."""
    args = ap.parse_args()
    try:
        accumulation_steps(args.micro_batch)
    except ValueError as e:
        ap.error(str(e))
    return args


def build_trainer(args: argparse.Namespace):
    """TRL's GRPOTrainer for the main job's work, configured by `args` (see `parser`).

    Returns (trainer, timing): `timing` is the current step's figures, filled while the trainer runs: rollout_s
    (seconds in TRL's `_generate`), forwarded (real prompt + completion tokens of the update's forwards), padded
    (positions the update's forwards run, padding included), trained (tokens under the loss mask), episodes, calls.
    Raises ValueError when `--micro-batch` does not divide the step's 16 sequences.
    """
    accumulation = accumulation_steps(args.micro_batch)

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer
    from trl.chat_template_utils import qwen3_template

    from ajet.model import load_tokenizer
    from ajet.task import Task
    from ajet.workflow import WorkflowOutput
    from math_workflow import SYSTEM_PROMPT, CalculatorTool, math_agent_reward

    torch.manual_seed(0)
    tokenizer = load_tokenizer(args.model, None)
    # ajet's tool template writes calls as Qwen 2.5 / Hermes do (<tool_call>{json}</tool_call> in <|im_start|> turns);
    # TRL does not recognise the template text, so it is told the matching response parser explicitly
    tokenizer.response_template = qwen3_template
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    tasks = [json.loads(line) for line in Path(args.tasks).read_text().splitlines() if line.strip()]
    tasks = tasks[:4 * args.steps]
    data = Dataset.from_list([{"prompt": [{"role": "system", "content": SYSTEM_PROMPT},
                                          {"role": "user", "content": t["query"]}],
                               "answer": t["answer"], "task_id": t["task_id"], "query": t["query"]} for t in tasks])

    timing = zeroed()

    def reward(completions, answer, task_id, query, **_):
        # the main job's metrics from TRL's messages: each assistant tool call with the tool message that answered
        # it, counted by the main job's own CalculatorTool (valid, grounded)
        out = []
        timing["episodes"] += len(completions)
        timing["calls"] += sum(1 for messages in completions for m in messages if m.get("role") == "assistant")
        for messages, ans, tid, q in zip(completions, answer, task_id, query):
            final = messages[-1].get("content") or "" if messages else ""
            calls = [tc for m in messages if m.get("role") == "assistant" for tc in m.get("tool_calls") or []]
            results = [str(m.get("content", "")) for m in messages if m.get("role") == "tool"]
            calculator = CalculatorTool(q)
            for call, result in zip(calls, results):
                # TRL writes a call it could not make as str({"error": ...}): an error to the main job too
                result = f"error: {result}" if result.startswith("{'error'") else result
                calculator.count((call.get("function") or {}).get("name", ""), _arguments(call), result)
            out.append(math_agent_reward(Task(task_id=tid, query=q, answer=ans),
                                         WorkflowOutput(final_answer=final, metrics=calculator.counts)))
        return out

    config = GRPOConfig(
        output_dir=str(Path(args.out).parent / "trl_out"), max_steps=args.steps,
        # one generation batch of 16 per optimizer step, trained in micro-batches: steps_per_generation equal to
        # gradient_accumulation_steps, so TRL needs no old-logprob forward (the samples are on-policy)
        per_device_train_batch_size=args.micro_batch, gradient_accumulation_steps=accumulation,
        steps_per_generation=accumulation,
        num_generations=4, max_completion_length=48 * 2 + 64, temperature=args.temperature, top_p=1.0, learning_rate=args.lr,
        lr_scheduler_type="constant", beta=0.0, loss_type="grpo", num_iterations=1, shuffle_dataset=False,
        use_cpu=True, bf16=args.bf16, fp16=False, logging_steps=1, report_to=[], save_strategy="no",
        max_tool_calling_iterations=1, gradient_checkpointing=args.gradient_checkpointing, seed=0,
        generation_kwargs={"max_new_tokens": 48})     # 48 tokens per turn; max_completion_length bounds the turns

    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=data,
                          processing_class=tokenizer, tools=[calculate])
    generate = trainer._generate

    def timed_generate(prompts):
        t0 = time.perf_counter()
        result = generate(prompts)
        timing["rollout_s"] += time.perf_counter() - t0
        return result

    trainer._generate = timed_generate
    compute_loss = trainer._compute_loss

    def counted_loss(model_, inputs):
        prompt_mask, completion_mask = inputs["prompt_mask"], inputs["completion_mask"]
        timing["forwarded"] += int(prompt_mask.sum() + completion_mask.sum())
        timing["padded"] += prompt_mask.numel() + completion_mask.numel()
        # the completion less the tool results TRL splices into it: what was sampled, all of it trained
        timing["trained"] += int((completion_mask * inputs.get("tool_mask", torch.ones_like(completion_mask))).sum())
        return compute_loss(model_, inputs)

    trainer._compute_loss = counted_loss

    return trainer, timing


def main() -> None:
    args = parse_args(parser())
    from transformers import TrainerCallback
    trainer, timing = build_trainer(args)

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *_a, **_k):
            self.t0 = time.perf_counter()
            timing.update(zeroed())

        def on_step_end(self, _args, state, *_a, **_k):
            step_s = time.perf_counter() - self.t0
            line = {"step": state.global_step, "step_s": step_s, "rollout_s": timing["rollout_s"],
                    "update_s": step_s - timing["rollout_s"], "generated_tokens": timing["trained"],
                    "forwarded_tokens": timing["forwarded"], "padded_tokens": timing["padded"],
                    "trained_tokens": timing["trained"],
                    "episodes": timing["episodes"], "calls": timing["calls"],
                    "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
            with open(args.out, "a") as f:
                f.write(json.dumps(line) + "\n")

    trainer.add_callback(StepTimer())
    trainer.train()


if __name__ == "__main__":
    main()
