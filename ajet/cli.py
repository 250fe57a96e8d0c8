"""`ajet` command line. Only argparse is imported until a command runs, so `ajet --help` is instant.

    ajet --conf tutorial/example_math_agent/math_agent.yaml --backbone=debug [--exp-dir DIR] [--steps N]
"""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ajet", description="Train an LLM agent workflow with reinforcement learning.",
        epilog="Example: ajet --conf tutorial/example_math_agent/math_agent.yaml --backbone=debug\n"
               "Also: ajet doctor --model MODEL (checks the chat template)\n"
               "      ajet eval --conf YAML [--checkpoint DIR] (held-out evaluation)",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--conf", required=True, metavar="YAML", help="experiment config file")
    p.add_argument("--backbone", choices=["debug", "verl", "trinity"],
                   help="RL backend: debug (one process, CPU or one GPU), verl (Ray+FSDP+vLLM), trinity")
    p.add_argument("--exp-dir", metavar="DIR", help="where metrics, trajectories and checkpoints go")
    p.add_argument("--steps", type=int, metavar="N", help="override trainer.total_steps")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in the experiment folder")
    return p


def doctor_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ajet doctor",
                                description="Check whether a model's chat template lets ajet merge calls exactly.")
    p.add_argument("--model", default="smollm2-135m-instruct", help="hub id, local folder or smollm2-135m-instruct")
    p.add_argument("--chat-template", help="'tools', a .jinja file or a template string (as model.chat_template)")
    return p


def eval_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ajet eval", description="Evaluate a config's workflow and judge on held-out "
                                "tasks (never trained on): mean reward, pass@1, pass@k, workflow metrics, eval.jsonl.")
    p.add_argument("--conf", required=True, metavar="YAML", help="experiment config file")
    who = p.add_mutually_exclusive_group()
    who.add_argument("--checkpoint", metavar="DIR", help="checkpoints/step_N folder, or an experiment folder (newest)")
    who.add_argument("--model", metavar="PATH", help="hub id, local folder or smollm2-135m-instruct")
    p.add_argument("--data", metavar="PATH", help="held-out task file (default: data.val_path)")
    p.add_argument("--n", type=int, metavar="K", help="episodes per task (pass@K); default eval.n")
    p.add_argument("--temperature", type=float, metavar="T", help="0 = greedy; default eval.temperature")
    p.add_argument("--out", metavar="DIR", help="output folder (default <exp_dir>/eval/<model>)")
    p.add_argument("--backbone", choices=["debug", "verl", "trinity"], help="engine to serve the policy with")
    return p


def main(argv: list[str] | None = None) -> int:
    """Parse `argv`, load the config, train (or `ajet doctor ...`). Returns the exit status (2 for user errors)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "eval":
        return _eval(eval_parser().parse_args(argv[1:]))
    from_doctor = bool(argv) and argv[0] == "doctor"
    args = (doctor_parser() if from_doctor else build_parser()).parse_args(argv[1:] if from_doctor else argv)
    from ajet.errors import AjetError

    if from_doctor:
        from ajet.doctor import main as doctor

        try:
            return doctor(args.model, args.chat_template)
        except (AjetError, OSError) as exc:
            print(f"ajet: error: {exc}", file=sys.stderr)
            return 2

    overrides = {k: v for k, v in (("backbone", args.backbone), ("trainer.exp_dir", args.exp_dir),
                                   ("trainer.total_steps", args.steps),
                                   ("trainer.resume", args.resume or None)) if v is not None}
    try:
        from ajet.config import load_config
        from ajet.trainer import run

        run(load_config(args.conf, overrides))
    except AjetError as exc:
        print(f"ajet: error: {exc}", file=sys.stderr)
        return 2
    return 0


def _eval(a: argparse.Namespace) -> int:
    from ajet.errors import AjetError
    from ajet.eval import main as evaluate

    try:
        evaluate(a.conf, a.checkpoint, a.model, a.data, a.n, a.temperature, a.out, a.backbone)
    except (AjetError, OSError) as exc:
        print(f"ajet: error: {exc}", file=sys.stderr)
        return 2
    return 0


def _entry() -> None:  # console-script entry point
    sys.exit(main())
