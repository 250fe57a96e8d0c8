"""The machine's cache of built venvs, shared by every checkout and installed ajet of one user:

    ${AJET_CI_VENV_CACHE:-${XDG_CACHE_HOME:-~/.cache}/ajet/ci-venvs}/<name>-<key>

`ajet backbone-env verl|trinity|vllm` (in a checkout: .ci/make_backbone_env.sh, .ci/make_vllm_env.sh) builds an
entry once per key (the key hashes what decides its contents); `<entry>/.complete` is written when its build
finished, and `<entry>.used` is touched each time a build or copy takes it (the scripts keep the most recently
used few). The vLLM engine looks here for its server's python when no `.venvs/vllm` is at hand
(ajet/engines/vllm_server.py), so a wheel's `ajet backbone-env vllm` serves runs started from any folder.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """The cache folder: $AJET_CI_VENV_CACHE, else $XDG_CACHE_HOME/ajet/ci-venvs, else ~/.cache/ajet/ci-venvs
    (the same rule as the build scripts'). It may not exist."""
    if os.environ.get("AJET_CI_VENV_CACHE"):
        return Path(os.environ["AJET_CI_VENV_CACHE"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "ajet" / "ci-venvs"


def newest_complete(name: str) -> Path | None:
    """The complete cached venv of `name` (e.g. `vllm`) used most recently (its `.used` stamp's time), or None.

    An entry without `.complete` (a build under way or one that failed) is never returned.
    """
    found = []
    for used in cache_dir().glob(f"{name}-*.used"):
        entry = used.with_suffix("")
        if (entry / ".complete").is_file():
            found.append((used.stat().st_mtime, entry))
    return max(found)[1] if found else None

