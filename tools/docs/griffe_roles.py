"""A griffe extension for the docs site's Python API page (``mkdocs.yml``, ``mkdocstrings`` options): the
package's docstrings cross-reference in reST roles (``:meth:`fit_task```,
``:class:`~proteus.config.RunConfig```), which mkdocstrings would show as written. Each role becomes the
inline code a reader expects: the name as written (``~`` keeps its last part, as Sphinx does), with ``()``
after a method or function.

    python tools/docs/griffe_roles.py ':class:`~proteus.config.RunConfig`'   # prints `RunConfig`
"""

from __future__ import annotations

import re
import sys
from typing import Any

import griffe

#: a reST role of the Python domain: ``:role:`target``` or ``:py:role:`~target```
ROLE = re.compile(r":(?:py:)?(meth|class|func|data|attr|mod|exc|obj|const|ref):`(~?)([^`<>]+?)`")
#: the roles Sphinx writes with ``()`` after the name
CALLABLE = frozenset({"meth", "func"})


def plain(text: str) -> str:
    """``text`` with every reST role replaced by inline code of the name it shows."""

    def one(m: re.Match[str]) -> str:
        role, short, target = m.groups()
        name = target.rsplit(".", 1)[-1] if short else target
        return f"`{name}{'()' if role in CALLABLE and not name.endswith(')') else ''}`"

    return ROLE.sub(one, text)


class PlainRoles(griffe.Extension):
    """Rewrite each loaded object's docstring with :func:`plain` before mkdocstrings renders it."""

    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = plain(obj.docstring.value)


if __name__ == "__main__":
    print(plain(" ".join(sys.argv[1:])))
