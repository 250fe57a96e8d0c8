"""`ajet --conf X.yaml`: train the config's workflow, run in this process (or on Ray actors with `--with-ray`)."""

from __future__ import annotations

from pathlib import Path

from ajet.config import AjetConfig


def train(cfg: AjetConfig) -> Path:
    """Train as `cfg` says in the in-process mode (`ajet.rollout.in_process.in_process_mode`: the config's datasets,
    its workflow and judge, dynamic sampling when enabled); returns the experiment folder.

    Raises:
        AjetError subclasses: what `ajet.trainer.run` raises (config, workflow, backbone problems; a run whose
            episodes keep failing).
    """
    from ajet.rollout.in_process import in_process_mode
    from ajet.trainer import run

    return run(cfg, in_process_mode())
