"""Griffe extensions for the API reference (docs/api.md), loaded by mkdocstrings (mkdocs.yml).

`InstalledNames`: the source folders `backbones/` and `tracker/` are installed as `ajet.backbones` and
`ajet.tracker` (setup.py), so they are attached under `ajet` and rendered with the names a user imports.
`NoPrivateParameters`: a parameter whose name starts with one underscore (e.g. `Tuner`'s `_client`, set by ajet
itself) is dropped from the rendered signatures, as the `!^_` filter drops private members.
"""

from __future__ import annotations

from typing import Any

import griffe

FOLDERS_UNDER_AJET = ("backbones", "tracker")


class InstalledNames(griffe.Extension):
    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        if pkg.name == "ajet":
            for name in FOLDERS_UNDER_AJET:
                pkg.set_member(name, loader.load(name))


class NoPrivateParameters(griffe.Extension):
    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        stack, seen = [pkg], set()
        while stack:
            obj = stack.pop()
            if obj.path in seen:
                continue
            seen.add(obj.path)
            for member in obj.members.values():
                if member.is_alias:
                    continue
                if member.is_function:
                    for name in [p.name for p in member.parameters]:
                        if name.startswith("_") and not name.startswith("__"):
                            del member.parameters[name]
                elif member.is_class or member.is_module:
                    stack.append(member)
