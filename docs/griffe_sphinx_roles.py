"""A griffe extension for the API reference: Sphinx-style roles in docstrings as inline code.

The docstrings are free-form prose that here and there use Sphinx roles
(:class:`~envmanager.SubprocessEnvManager`, :func:`check`, :data:`FAULTS`) and reST's ``::``
before a code block. Markdown knows neither, so this rewrites each role to inline code (the
last part of the name where the role has ``~``, the title of ``title <target>``) and ``text::`` to ``text:`` before
mkdocstrings renders the docstring. Loaded by mkdocs.yml (plugins.mkdocstrings.handlers.python.
options.extensions); no effect on the code.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:py:)?(?:class|func|meth|attr|mod|data|obj|exc|const):`(~?)([^`]+)`")
LITERAL = re.compile(r"(\S)::$", re.MULTILINE)


def _role(match: re.Match[str]) -> str:
    tilde, target = match.groups()
    titled = re.fullmatch(r"(.+?)\s*<[^>]+>", target)  # :meth:`title <target>`
    if titled:
        return f"`{titled.group(1)}`"
    return f"`{target.rsplit('.', 1)[-1] if tilde else target}`"


class SphinxRoles(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            text = ROLE.sub(_role, obj.docstring.value)
            obj.docstring.value = LITERAL.sub(r"\1:", text)
