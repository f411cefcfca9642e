"""MkDocs hook: the docstrings' Sphinx roles (:func:`x`, :class:`~a.b.C`) read as code in the API reference.

mkdocstrings renders Google-style sections but not reStructuredText roles, which would show as
``:func:`` before the name: the role is dropped, and ``~a.b.C`` shows as ``C`` (Sphinx's meaning).
"""
import re

ROLES = r":(?:func|class|meth|mod|attr|data|exc|obj):"
SHORT = re.compile(ROLES + r"<code>~(?:[\w.]+\.)?(?=\w+</code>)")
PLAIN = re.compile(ROLES + r"<code>")


def on_page_content(html: str, **kwargs) -> str:
    return PLAIN.sub("<code>", SHORT.sub("<code>", html))
