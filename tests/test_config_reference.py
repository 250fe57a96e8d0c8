"""The configuration reference (docs/configuration.md) covers every config field, each with a description, and the
committed page is the one `python -m ajet.config_reference` generates."""

from __future__ import annotations

import inspect
import subprocess
import sys
from pathlib import Path

from pydantic import BaseModel

import ajet.config
from ajet.config_reference import all_fields, groups, markdown

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "configuration.md"


def _row(page: str, key: str) -> list[str]:
    """The cells of the table row of `key` (unescaped pipes split the cells)."""
    line = next(ln for ln in page.splitlines() if ln.startswith(f"| `{key}` |"))
    return [c.strip() for c in line.replace("\\|", "\x00").strip("|").split("|")]


def test_every_field_has_a_description():
    missing = [f.path for _, f in all_fields() if not (f.owner.model_fields[f.name].description or "").strip()]
    assert not missing, ("config fields without a description (add `Field(description=...)` in ajet/config/, "
                         f"with the unit and range): {missing}")


def test_every_config_model_is_in_the_reference():
    """A model of ajet.config that no walk reaches (held in a new kind of container, say) would be left out."""
    reached = {g.model for g in groups()}
    models = {m for _, m in inspect.getmembers(ajet.config, inspect.isclass)
              if issubclass(m, BaseModel) and m.__module__.startswith("ajet.config.") and m.model_fields}
    assert models - reached == set()


def test_committed_page_is_up_to_date():
    assert PAGE.is_file(), "docs/configuration.md is missing: python -m ajet.config_reference --write " \
                           "docs/configuration.md"
    assert PAGE.read_text() == markdown(), ("docs/configuration.md is out of date: run "
                                            "python -m ajet.config_reference --write docs/configuration.md")


def test_rows_say_type_default_allowed_unit_and_backbones():
    """Spot checks against what the config and the backbone declarations say, written out by hand here."""
    page = markdown()
    key, typ, default, allowed, unit, desc, backbones = _row(page, "rollout.episode_timeout_s")
    assert (typ, default, allowed, unit) == ("float", "`600.0`", "> 0", "seconds") and desc
    assert backbones == "all (ajet implements it)"
    _, typ, default, allowed, unit, _, backbones = _row(page, "rollout.top_p")
    assert (default, allowed) == ("`1.0`", "> 0; <= 1")
    assert backbones == "debug; verl only at its default; trinity only at its default"
    _, typ, default, allowed, _, _, backbones = _row(page, "model.dtype")
    assert (default, allowed) == ('`"float32"`', "`float32`, `bfloat16`, `float16`")
    _, typ, default, _, unit, _, backbones = _row(page, "trainer.async.max_staleness")
    assert (typ, default, unit) == ("int \x00 None", "None", "policy versions")
    assert backbones == "debug; verl only when unset or 0; trinity only when unset or 0"
    # the fields of models held in a dict, a list and a union are there too
    for k in ("harnesses.NAME.api", "tools.mcp_servers.NAME.url", "data.train[].weight", "workflow.harness",
              "workflow.command", "workflow.sandbox.memory_mb"):
        assert _row(page, k)[5], k
    assert _row(page, "workflow.sandbox.memory_mb")[4] == "MiB"


def test_check_flag_reports_an_out_of_date_page(tmp_path):
    stale = tmp_path / "configuration.md"
    stale.write_text(markdown().replace("seconds", "minutes", 1))
    r = subprocess.run([sys.executable, "-m", "ajet.config_reference", "--check", str(stale)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "out of date" in r.stdout
    subprocess.run([sys.executable, "-m", "ajet.config_reference", "--write", str(stale)], check=True, timeout=120)
    assert stale.read_text() == markdown()
