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
               "Also: ajet doctor --model MODEL (checks the chat template)",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--conf", required=True, metavar="YAML", help="experiment config file")
    p.add_argument("--backbone", choices=["debug", "verl", "trinity"],
                   help="RL backend: debug (one process, CPU or one GPU), verl (Ray+FSDP+vLLM), trinity")
    p.add_argument("--exp-dir", metavar="DIR", help="where metrics, trajectories and checkpoints go")
    p.add_argument("--steps", type=int, metavar="N", help="override trainer.total_steps")
    p.add_argument("--with-ray", nargs="?", const=2, type=int, metavar="N",
                   help="run episodes on N Ray actors (default 2; rollout.ray_workers); needs pip install 'ajet[ray]'")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in the experiment folder")
    return p


def doctor_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ajet doctor",
                                description="Check whether a model's chat template lets ajet merge calls exactly.")
    p.add_argument("--model", default="smollm2-135m-instruct", help="hub id, local folder or smollm2-135m-instruct")
    p.add_argument("--chat-template", help="'tools', a .jinja file or a template string (as model.chat_template)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Parse `argv`, load the config, train (or `ajet doctor ...`). Returns the exit status (2 for user errors)."""
    argv = sys.argv[1:] if argv is None else argv
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
                                   ("trainer.total_steps", args.steps), ("rollout.ray_workers", args.with_ray),
                                   ("trainer.resume", args.resume or None)) if v is not None}
    try:
        from ajet.config import load_config
        from ajet.trainer import run

        run(load_config(args.conf, overrides))
    except AjetError as exc:
        print(f"ajet: error: {exc}", file=sys.stderr)
        return 2
    return 0


def _entry() -> None:  # console-script entry point
    sys.exit(main())
