"""The README as a page of the UI plugin, so the trigger form's help can link to the section it cuts short.

Rendered with markdown-it (a requirement of ``rich``, already installed), each heading given the anchor GitHub
gives it (:func:`github_slug`), so ``/eagleflow/readme#drafter-families-…`` opens where the same link opens on the
repository's page. A deployment without the README (an image that installs the package alone) answers 404.
"""

from __future__ import annotations

import html
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fastapi import Request
from fastapi.responses import HTMLResponse

README = Path(__file__).resolve().parents[1] / "README.md"


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: markup dropped, lowercase, punctuation but '-' and '_' stripped, spaces -> '-'."""
    text = re.sub(r"`([^`]*)`", r"\1", heading)
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def readme_html(readme: Path = README) -> str | None:
    """The README as one HTML page, its headings anchored as on GitHub; None when there is no README."""
    from markdown_it import MarkdownIt

    try:
        text = readme.read_text(encoding="utf-8")
    except OSError:
        return None
    md = MarkdownIt("commonmark").enable("table")
    tokens = md.parse(text)
    for opening, inline in zip(tokens, tokens[1:]):
        if opening.type == "heading_open":
            opening.attrSet("id", github_slug(inline.content))
    body = md.renderer.render(tokens, md.options, {})
    return (
        "<!doctype html><html><head><meta charset='utf-8'><title>eagleflow README</title><style>"
        "body{font-family:sans-serif;max-width:1100px;margin:2em auto;line-height:1.5}table{border-collapse:collapse}"
        "td,th{border:1px solid #ccc;padding:2px 6px}pre{background:#f6f6f6;padding:8px;overflow:auto}img{max-width:100%}"
        f"</style></head><body>{body}<p>{html.escape(str(readme.name))}</p></body></html>"
    )


def add_readme_route(app: Any, error_response: Callable[[Any, int, str], Any]) -> None:
    """``GET /readme`` on the plugin's app: the README page, or the plugin's 404 where there is none."""
    @app.get("/readme", response_class=HTMLResponse)
    def readme(request: Request) -> Any:
        """The README, each heading anchored as on GitHub: the trigger form's help links to its sections."""
        page = readme_html()
        return HTMLResponse(page) if page is not None else error_response(request, 404, "this deployment has no README")
