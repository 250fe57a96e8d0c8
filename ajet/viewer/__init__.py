"""See what the agent learned: `ajet view` (browser), `ajet show` (terminal), end-of-run plots.

    ajet view experiments/math_agent --port 8420   # run overview -> step -> episode -> sample, token by token
    ajet show experiments/math_agent --episode s3-t1-r0
"""

from __future__ import annotations

import argparse


def main(command: str, args: argparse.Namespace) -> int:
    """Run `ajet view` (serves until Ctrl-C) or `ajet show` (prints and returns 0).

    Raises:
        AjetError: the folder holds no trajectories.sqlite, or the episode/step does not exist.
    """
    if command == "view":
        from ajet.viewer.app import serve

        serve(args.exp_dir, port=args.port)
        return 0
    from ajet.viewer.show import show

    show(args.exp_dir, step=args.step, episode=args.episode)
    return 0
