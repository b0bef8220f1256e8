"""WebShop's pages as upstream's templates show them, and their three renderings.

A page is a list of :class:`Segment` (the visible strings of upstream's HTML in document
order, each marked as plain text, a button, a product link or an option label) plus its
clickables. The renderings follow ``web_agent_site/envs/web_agent_text_env.py``:

* ``text``: the visible strings, stripped, joined by `` [SEP] ``;
* ``text_rich``: one string per line, buttons as ``[button] X [button_]``, selected
  options and visited products as ``[clicked button] X [clicked button_]``, and a
  ``You have clicked X.`` line per selected option at the top;
* ``html``: the page as HTML with upstream's ids and classes (``search_input``,
  ``btn``, ``product-link``, radio inputs), without stylesheets or scripts.

Upstream's templates leave whitespace-only text nodes between tags, which its ``text``
mode would turn into empty `` [SEP] `` fields; observations recorded from the running
upstream env (and every published WebShop trajectory) have none, so neither do these.

The clickables are upstream's ``get_available_actions``: the lowercased text of every
button, then every product link, then every option value (as written, already
lowercase), in page order; a later duplicate replaces an earlier one.
"""

from __future__ import annotations

import dataclasses
import html as _html
import json
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = [
    "Segment",
    "Page",
    "END_BUTTON",
    "NEXT_PAGE",
    "PREV_PAGE",
    "BACK_TO_SEARCH",
    "SUB_PAGES",
    "PRODUCT_WINDOW",
    "search_page",
    "results_page",
    "item_page",
    "sub_page",
    "done_page",
    "render",
]

END_BUTTON = "Buy Now"
NEXT_PAGE = "Next >"
PREV_PAGE = "< Prev"
BACK_TO_SEARCH = "Back to Search"
#: Item sub-pages, by button text.
SUB_PAGES = ("Description", "Features", "Reviews", "Attributes")
#: Products per results page.
PRODUCT_WINDOW = 10


@dataclasses.dataclass(frozen=True)
class Segment:
    """One visible string of a page.

    Attributes:
        text: The string as the template renders it.
        kind: ``text``, ``button``, ``link`` (a product ASIN) or ``option`` (a label).
        group: For options, the option name (the radio group).
        selected: For options, selected in this session; for links, visited before.
    """

    text: str
    kind: str = "text"
    group: str | None = None
    selected: bool = False


@dataclasses.dataclass(frozen=True)
class Page:
    """A rendered page: its name, visible segments and what can be clicked."""

    name: str
    segments: tuple[Segment, ...]
    has_search_bar: bool = False

    @property
    def clickables(self) -> dict[str, Segment]:
        """Lowercased clickable text -> its segment, in upstream's order."""
        out: dict[str, Segment] = {}
        for s in self.segments:
            if s.kind in ("button", "link"):
                out[s.text.lower()] = s
        for s in self.segments:
            if s.kind == "option":
                out[s.text] = s
        return out


def _instruction(instruction: str) -> list[Segment]:
    return [Segment("Instruction:"), Segment(instruction)]


def search_page(instruction: str) -> Page:
    """The start page: logo, instruction, search box."""
    return Page(
        "search",
        (Segment("WebShop"), *_instruction(instruction), Segment("Search", "button")),
        has_search_bar=True,
    )


def results_page(
    instruction: str,
    page_num: int,
    total: int,
    products: Sequence[Mapping[str, Any]],
    visited: frozenset[str] | set[str],
) -> Page:
    """One page of search results (``products`` are this page's, at most 10)."""
    segs = [*_instruction(instruction), Segment(BACK_TO_SEARCH, "button")]
    segs.append(Segment(f"Page {page_num} (Total results: {total})"))
    if page_num > 1:
        segs.append(Segment(PREV_PAGE, "button"))
    segs.append(Segment(NEXT_PAGE, "button"))  # upstream shows it even on the last page
    for p in products:
        segs.append(Segment(p["asin"], "link", selected=p["asin"] in visited))
        segs.append(Segment(p["Title"]))
        segs.append(Segment(p["Price"]))
    return Page("results", tuple(segs))


def item_page(
    instruction: str,
    product: Mapping[str, Any],
    options: Mapping[str, str],
    show_attrs: bool = False,
) -> Page:
    """A product page: options, title, price, rating, sub-page buttons, Buy Now."""
    chosen = json.dumps(dict(options))  # upstream marks a label clicked if '"label"' is here
    segs = [*_instruction(instruction), Segment(BACK_TO_SEARCH, "button")]
    segs.append(Segment(PREV_PAGE, "button"))
    for name, values in product["options"].items():
        segs.append(Segment(name))
        for v in values:
            segs.append(Segment(v, "option", group=name, selected=f'"{v}"' in chosen))
    segs += [
        Segment(product["Title"]),
        Segment(f"Price: {product['Price']}"),
        Segment(f"Rating: {product['Rating']}"),
    ]
    for name in SUB_PAGES[: 4 if show_attrs else 3]:
        segs.append(Segment(name, "button"))
    segs.append(Segment(END_BUTTON, "button"))
    return Page("item", tuple(segs))


def sub_page(instruction: str, product: Mapping[str, Any], name: str) -> Page:
    """The Description, Features, Reviews or Attributes page of a product."""
    segs = [*_instruction(instruction), Segment(BACK_TO_SEARCH, "button")]
    segs.append(Segment(PREV_PAGE, "button"))
    if name == "Description":
        segs.append(Segment(product["Description"]))
    elif name == "Features":
        segs += [Segment(b) for b in product["BulletPoints"]]
    elif name == "Reviews":
        for r in product["Reviews"]:
            segs += [Segment(f'"{r.get("title", "")}"'), Segment(str(r.get("score", "")))]
            segs.append(Segment(str(r.get("body", ""))))
    elif name == "Attributes":
        segs += [Segment(a) for a in product["Attributes"]]
        segs += [Segment(product["category"]), Segment(product["query"])]
        segs.append(Segment(product["product_category"]))
    else:
        raise ValueError(f"unknown sub-page {name!r}; expected one of {SUB_PAGES}")
    return Page(name, tuple(segs))


def _tojson(options: Mapping[str, str]) -> str:
    """Flask's ``tojson`` filter: sorted keys, ASCII, HTML-unsafe characters escaped."""
    s = json.dumps(dict(options), sort_keys=True)
    return (s.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")).replace(
        "'", "\\u0027"
    )


def done_page(asin: str, options: Mapping[str, str], reward: float) -> Page:
    """The page after Buy Now, as the upstream text env renders it (most fields None)."""
    texts = [
        "Thank you for shopping with us!", "Your code:", "None",
        "(Paste it in your MTurk interface.)", "Purchased", "asin", asin, "options",
        _tojson(options), "attrs", "None", "category", "None", "query", "None",
        "product category", "None", "Target", "asin", "options", "attrs", "price upper",
        "instuction text", "category", "product category", "query", "Goal", "None",
        "Reward", "Your score (min 0.0, max 1.0)", repr(float(reward)), "Reward Details",
        "None",
    ]  # fmt: skip
    return Page("done", tuple(Segment(t) for t in texts))


# ------------------------------------------------------------------------ renderings


def _visible(page: Page) -> list[Segment]:
    return [s for s in page.segments if s.text.strip()]


def render_text(page: Page) -> str:
    """``text`` mode: visible strings joined by `` [SEP] ``."""
    return " [SEP] ".join(s.text.strip() for s in _visible(page))


def render_text_rich(page: Page) -> str:
    """``text_rich`` mode: one string per line, buttons and clicked items marked."""
    lines: list[str] = []
    clicked: list[str] = []
    for s in _visible(page):
        t = s.text.strip()
        if s.kind == "button":
            lines.append(f"[button] {t} [button_]")
        elif s.kind == "option":
            mark = "clicked button" if s.selected else "button"
            lines.append(f"  [{mark}] {t} [{mark}_]")
            if s.selected:
                clicked.append(t)
        elif s.kind == "link":
            mark = "clicked button" if s.selected else "button"
            lines.append(f"\n[{mark}] {t} [{mark}_]")
        else:
            lines.append(t)
    head = "".join(f"You have clicked {t}.\n" for t in reversed(clicked))
    return head + "".join(line + "\n" for line in lines)


def render_html(page: Page) -> str:
    """``html`` mode: the page's strings in upstream's markup (ids, classes, inputs)."""
    e = _html.escape
    out = ["<!DOCTYPE html>", "<html>", "<body>", '<div class="container">']
    segs = list(page.segments)
    i = 0
    while i < len(segs):
        s = segs[i]
        if s.text == "Instruction:" and i + 1 < len(segs):
            out.append(
                f'<div id="instruction-text"><h4>Instruction:<br>{e(segs[i + 1].text)}</h4></div>'
            )
            i += 2
            continue
        if s.kind == "button":
            if page.has_search_bar:
                out.append(
                    '<form><input id="search_input" type="text" name="search_query" '
                    'placeholder="Search..." required/>'
                    f'<button class="btn btn-success" type="submit">{e(s.text)}</button></form>'
                )
            else:
                out.append(f'<button type="submit" class="btn btn-primary">{e(s.text)}</button>')
        elif s.kind == "link":
            out.append(f'<h4 class="product-asin"><a class="product-link">{e(s.text)}</a></h4>')
        elif s.kind == "option":
            group = e(s.group or "")
            checked = " checked" if s.selected else ""
            out.append(
                f'<input type="radio" name="{group}" value="{e(s.text)}"{checked}>'
                f"<label>{e(s.text)}</label>"
            )
        else:
            out.append(f"<p>{e(s.text)}</p>")
        i += 1
    out += ["</div>", "</body>", "</html>"]
    return "\n".join(out)


_RENDERERS = {"text": render_text, "text_rich": render_text_rich, "html": render_html}


def render(page: Page, mode: str) -> str:
    """Render ``page`` in observation mode ``mode`` (``text``, ``text_rich`` or ``html``)."""
    return _RENDERERS[mode](page)
