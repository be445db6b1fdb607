"""MkDocs hook: every public name has an API reference.

mkdocstrings already fails the build when a ``::: identifier`` names nothing. This hook fails it
the other way round: when a name in the ``__all__`` of a public module (``PUBLIC``) is not
documented by some ``::: identifier`` in ``docs/api/`` (the same object under any of its import
paths), e.g. after a class is added to ``envmanager.sampler`` without a reference entry. The
sources are read statically with griffe, as mkdocstrings reads them: nothing is imported.
Loaded by mkdocs.yml (``hooks:``); no effect on the code.
"""

from __future__ import annotations

import ast
import os
import re
from typing import Any

import griffe
from mkdocs.exceptions import PluginError

#: Modules whose ``__all__`` is the public API the reference must cover.
PUBLIC = (
    "envmanager",
    "envmanager.errors",
    "envmanager.core",
    "envmanager.sampler",
    "envmanager.ray",
    "envmanager.sb3",
    "envmanager.mlagents",
    "envmanager.pettingzoo",
    "envmanager.testing",
    "envmanager.check",
)

DIRECTIVE = re.compile(r"^:::\s*([\w.]+)\s*$", re.MULTILINE)

_documented: dict[str, str] = {}  # identifier -> page


def on_pre_build(config: Any) -> None:
    _documented.clear()


def on_page_markdown(markdown: str, page: Any, **kwargs: Any) -> str:
    if page.file.src_uri.startswith("api/"):
        for identifier in DIRECTIVE.findall(markdown):
            _documented[identifier] = page.file.src_uri
    return markdown


def _canonical(package: griffe.Module, path: str) -> str | None:
    try:
        obj = package[path.split(".", 1)[1]] if "." in path else package
    except KeyError:
        return None
    try:
        return obj.final_target.path if obj.is_alias else obj.path
    except griffe.AliasResolutionError:
        return obj.path


def _exports(module: griffe.Module) -> dict[str, str]:
    """``name -> canonical path`` for the module's ``__all__``."""
    names = list(module.exports or ())
    lazy: dict[str, str] = {}
    if not names and "_EXPORTS" in module.members:  # envmanager.mlagents: __all__ = list(_EXPORTS)
        lazy = ast.literal_eval(str(module["_EXPORTS"].value))
        names = list(lazy)
    out = {}
    for name in names:
        if name in lazy:
            out[name] = f"{lazy[name]}.{name}"
        else:
            out[name] = _canonical(module.package, f"{module.path}.{name}") or f"{module.path}.{name}"
    return out


def on_post_build(config: Any) -> None:
    root = os.path.dirname(os.path.abspath(config.config_file_path))
    package = griffe.load("envmanager", search_paths=[root], resolve_aliases=True)
    documented = {_canonical(package, identifier) for identifier in _documented}
    missing = []
    for path in PUBLIC:
        module = package if path == "envmanager" else package[path.split(".", 1)[1]]
        for name, canonical in _exports(module).items():
            if canonical not in documented:
                missing.append(f"{path}.{name}")
    if missing:
        raise PluginError(
            "public names with no API reference (add a '::: <name>' to a page in docs/api/): "
            + ", ".join(missing)
        )
