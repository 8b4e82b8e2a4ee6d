"""A reply's Markdown as HTML that cannot carry anything but text and formatting.

markdown-it-py with raw HTML off (a reply that writes <script> shows it as text), images
off (a reply cannot make the browser fetch anything; the page's CSP would refuse it
anyway), and links kept only for http(s) and mailto, opened as plain navigations with
rel="noopener noreferrer nofollow". This output is the one place a template shows HTML made
in Python (`Markup`): everything in it came out of this renderer."""

from __future__ import annotations

from markdown_it import MarkdownIt
from markupsafe import Markup

_SAFE_SCHEMES = ("http://", "https://", "mailto:")

_md = MarkdownIt("commonmark", {"html": False, "linkify": False, "typographer": False})
_md.disable(["image", "html_inline", "html_block"])
_md.enable(["table", "strikethrough"])


def _validate_link(url: str) -> bool:
    return url.strip().lower().startswith(_SAFE_SCHEMES)


_md.validateLink = _validate_link


def _link_open(renderer, tokens, idx, options, env):
    tokens[idx].attrSet("rel", "noopener noreferrer nofollow")
    return renderer.renderToken(tokens, idx, options, env)


_md.add_render_rule("link_open", _link_open)


def render(text: str) -> Markup:
    """`text` (Markdown) as safe HTML."""
    return Markup(_md.render(text))  # safe by construction: see the module docstring
