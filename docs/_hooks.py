"""MkDocs hook: Sphinx roles in the docstrings (``:func:`kvpool.size_for```) read as plain code.

The docstrings follow the numpy convention, whose cross-references are Sphinx roles; the API
page is rendered by mkdocstrings, which shows the role's name before the code. This drops it.
"""

import re

_ROLE = re.compile(r":(?:class|func|meth|data|mod|attr|exc|obj):(<code>)")


def on_page_content(html, **kwargs):
    """Remove the ``:role:`` prefix in front of inline code on every page."""
    return _ROLE.sub(r"\1", html)
