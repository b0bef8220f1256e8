"""WebShop's reward, as upstream ``web_agent_site/engine/goal.py`` computes it.

For a purchased product ``p`` (price ``x``, chosen options ``O``) and a goal with
attributes ``A``, goal options ``G`` and a price bound ``u``::

    R = r_type * (n_att + n_opt + [x <= u]) / (|A| + |G| + 1)

* ``n_att`` counts goal attributes that match one of the product's attributes with
  thefuzz ``token_set_ratio > 85``, or else occur as a substring of its title, bullet
  points or description (:func:`get_attribute_reward`);
* ``n_opt`` counts goal options matched by a chosen option (``token_set_ratio > 85``)
  after colour normalisation (:func:`normalize_color`, :func:`get_option_reward`);
* ``r_type`` is 1, 0.5, 0.1 or 0 from the query match, the category-path overlap and
  the overlap of the nouns of the two product names (:func:`get_type_reward`).

Fuzzy scores come from ``thefuzz`` itself (its preprocessing, ASCII forcing and integer
rounding), so the thresholds behave exactly as upstream's.

Title nouns: upstream tags both names with spaCy (``en_core_web_lg``) and keeps
``NOUN``/``PROPN`` tokens. Here the nouns come, in order of preference, from a
precomputed list carried by the product (``title_nouns``) or goal (``name_nouns``),
from spaCy when a model is installed, or from a documented token heuristic
(:func:`heuristic_nouns`), which approximates spaCy and is not bit-identical to it.
Install the ``webshop-spacy`` extra and a model (offline: ``pip install
./en_core_web_lg-3.8.0-py3-none-any.whl``) to grade real data as upstream does; real
data graded with the heuristic is warned about once per process
(:func:`warn_if_heuristic_on_real_data`). ``BRANCHGYM_SPACY_MODEL`` names another
installed model package or a model folder to use first (a repackaged model, a local path).
"""

from __future__ import annotations

import functools
import logging
import os
import re
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from thefuzz import fuzz

from branchgym.error import DataError

__all__ = [
    "COLOR_SET",
    "PRICE_RANGE",
    "normalize_color",
    "get_type_reward",
    "get_attribute_reward",
    "get_option_reward",
    "get_reward",
    "title_nouns",
    "heuristic_nouns",
    "noun_backend",
    "spacy_pipeline",
    "spacy_nouns",
    "warn_if_heuristic_on_real_data",
    "SPACY_MODEL_ENV",
]

#: Environment variable naming the spaCy model (package name or folder) to use first.
SPACY_MODEL_ENV = "BRANCHGYM_SPACY_MODEL"

logger = logging.getLogger(__name__)
_WARNED: set[str] = set()

#: Upstream's price grid for goal price bounds: 10, 20, ..., 990 dollars.
PRICE_RANGE: tuple[float, ...] = tuple(10.0 * i for i in range(1, 100))

#: Upstream ``engine/normalize.py`` colour list, in its order (the first hit wins).
COLOR_SET: tuple[str, ...] = (
    "alabaster", "apricot", "aqua", "ash", "asphalt", "azure", "banana", "beige", "black",
    "blue", "blush", "bordeaux", "bronze", "brown", "burgundy", "camel", "camo", "caramel",
    "champagne", "charcoal", "cheetah", "chestnut", "chocolate", "christmas", "coffee",
    "cognac", "copper", "coral", "cranberry", "cream", "crystal", "dark", "denim",
    "eggplant", "elephant", "espresso", "fuchsia", "gold", "granite", "grape", "graphite",
    "grass", "gray", "green", "grey", "heather", "indigo", "ivory", "ivy", "khaki",
    "lavender", "lemon", "leopard", "light", "lilac", "lime", "magenta", "maroon", "mauve",
    "merlot", "midnight", "mint", "mocha", "multicolor", "mushroom", "mustard", "natural",
    "navy", "nude", "olive", "orange", "peach", "pewter", "pink", "plum", "purple",
    "rainbow", "red", "rose", "royal", "rust", "sand", "sapphire", "seashell", "silver",
    "skull", "slate", "steel", "stone", "stonewash", "sunflower", "tan", "taupe", "teal",
    "tiger", "turquoise", "violet", "walnut", "wheat", "white", "wine", "yellow",
)  # fmt: skip

_FUZZY_THRESHOLD = 85


def normalize_color(color: Any) -> Any:
    """Return the first :data:`COLOR_SET` entry contained in ``color``, else ``color``.

    ``in`` is Python's: a substring test for strings (``"black forest"`` -> ``"black"``,
    ``"violet lavender"`` -> ``"lavender"``, since the list order decides) and an
    element test for the ``(name, value)`` tuples upstream passes for dict goal options.
    """
    for norm in COLOR_SET:
        if norm in color:
            return norm
    return color


# ------------------------------------------------------------------------ nouns

# Function words and the most common title adjectives/units that spaCy does not tag as
# nouns; used only by the fallback heuristic.
_NON_NOUNS = frozenset(
    """a an the and or of for with without in on at to from by as is are be it its this that
    these those your you our we my his her their x vs per plus new best premium pack set
    pcs pc piece pieces count ct oz fl lb lbs inch inches ft cm mm ml l kg g
    small medium large big extra mini super ultra soft hard light dark long short high low
    natural organic professional portable adjustable durable waterproof wireless compatible
    women womens men mens kids unisex adult adults girls boys baby""".split()
)
_TOKEN_RE = re.compile(r"[A-Za-z][A-Za-z'\-]*")


def heuristic_nouns(name: str) -> list[str]:
    """Approximate spaCy's ``NOUN``/``PROPN`` tokens of a product name without a model.

    Keeps lowercased alphabetic tokens of two or more letters that are not function
    words, units or common title adjectives. Numbers and punctuation are dropped, as
    spaCy tags them ``NUM``/``PUNCT``.
    """
    out = []
    for tok in _TOKEN_RE.findall(name):
        t = tok.lower().strip("'-")
        if len(t) >= 2 and t not in _NON_NOUNS:
            out.append(t)
    return out


@functools.lru_cache(maxsize=1)
def _spacy_nlp() -> Any:
    """The spaCy pipeline upstream uses, if spaCy and a model are installed; else None."""
    try:
        import spacy
    except ImportError:
        return None
    named = os.environ.get(SPACY_MODEL_ENV)
    if named:
        try:
            return spacy.load(named, disable=["parser", "ner", "lemmatizer"])
        except OSError as e:
            raise DataError(
                f"{SPACY_MODEL_ENV}={named!r} is not an installed spaCy model or a model "
                f"folder ({e}); install the model wheel, or unset {SPACY_MODEL_ENV} to use "
                "en_core_web_lg/_md/_sm when installed."
            ) from e
    for model in ("en_core_web_lg", "en_core_web_md", "en_core_web_sm"):
        try:
            return spacy.load(model, disable=["parser", "ner", "lemmatizer"])
        except OSError:  # model not installed: never download at run time
            continue
    return None


def spacy_pipeline() -> Any:
    """The spaCy pipeline title nouns come from, or ``None`` when none is installed."""
    return _spacy_nlp()


def noun_backend() -> str:
    """``spacy:<model>`` when a spaCy model is installed, else ``heuristic``."""
    nlp = _spacy_nlp()
    return f"spacy:{nlp.meta.get('name', '?')}" if nlp is not None else "heuristic"


def warn_if_heuristic_on_real_data(source: str, products: Iterable[Mapping[str, Any]]) -> bool:
    """Warn once per data source when real data will be graded with the noun heuristic.

    That is: no spaCy model is installed and a product has no precomputed
    ``title_nouns``. Warns with ``warnings.warn`` and the module's logger; returns
    whether the heuristic grades this real data.
    """
    if source == "generated" or all("title_nouns" in p for p in products):
        return False
    if noun_backend() != "heuristic":
        return False
    if source not in _WARNED:
        _WARNED.add(source)
        msg = (
            f"WebShop data {source!r} is graded with the title-noun HEURISTIC, not spaCy as "
            "upstream: the type factor r_type can differ from upstream's. Install spaCy and "
            "an English model (pip install 'branchgym[webshop-spacy]' and, offline, pip "
            "install ./en_core_web_lg-3.8.0-py3-none-any.whl) to grade as upstream does."
        )
        warnings.warn(msg, UserWarning, stacklevel=3)
        logger.warning(msg)
    return True


@functools.lru_cache(maxsize=200_000)
def title_nouns(name: str) -> tuple[str, ...]:
    """Lowercased noun tokens of a product name, as upstream's type reward sees them."""
    nlp = _spacy_nlp()
    if nlp is None:
        return tuple(heuristic_nouns(name))
    return spacy_nouns(nlp, name)


def spacy_nouns(nlp: Any, name: str) -> tuple[str, ...]:
    """Lowercased ``NOUN``/``PROPN`` tokens of ``name`` under the spaCy pipeline ``nlp``."""
    return tuple(t.text.lower() for t in nlp(name) if t.pos_ in ("PNOUN", "NOUN", "PROPN"))


def _nouns(record: Mapping[str, Any], precomputed_key: str) -> Sequence[str]:
    pre = record.get(precomputed_key)
    if pre is not None:
        return pre
    return title_nouns(str(record["name"]))


# ----------------------------------------------------------------------- reward


def get_type_reward(purchased_product: Mapping[str, Any], goal: Mapping[str, Any]) -> dict:
    """Type factor: does the purchase belong to the wanted kind of product?

    Returns upstream's dict: ``r_type``, ``query_match``, ``category_match``,
    ``title_score``. ``r_type`` is 1 when the scraping queries match, at least two
    ``›``-separated category segments are shared, or more than 20 % of the goal name's
    nouns appear in the purchased name; 0.5 otherwise; then 0.1 if the noun share is
    under 0.1 and 0 if it is 0 (the later rules override the earlier ones, as upstream).
    """
    query_match = purchased_product["query"] == goal["query"]
    p_cat = {x.strip() for x in purchased_product["product_category"].split("›")}
    g_cat = {x.strip() for x in goal["product_category"].split("›")}
    category_match = len(p_cat & g_cat) >= 2

    purchased = list(_nouns(purchased_product, "title_nouns"))
    desired = list(_nouns(goal, "name_nouns"))
    n_intersect = len(set(purchased) & set(desired))
    title_score = 0.2 if len(desired) == 0 else n_intersect / len(desired)

    r_type = 1.0
    if not (query_match or category_match or title_score > 0.2):
        r_type = 0.5
    if title_score < 0.1:
        r_type = 0.1
    if title_score == 0.0:
        r_type = 0.0
    return {
        "r_type": r_type,
        "query_match": query_match,
        "category_match": category_match,
        "title_score": title_score,
    }


def get_attribute_reward(
    purchased_product: Mapping[str, Any], goal: Mapping[str, Any]
) -> tuple[float, int]:
    """``(r_att, n_att)``: share and count of goal attributes the product has."""
    purchased_attrs = purchased_product["Attributes"]
    goal_attrs = goal["attributes"]
    n = 0
    for g_attr in goal_attrs:
        matched = any(fuzz.token_set_ratio(p, g_attr) > _FUZZY_THRESHOLD for p in purchased_attrs)
        if not matched and (
            g_attr in purchased_product["Title"].lower()
            or g_attr in " ".join(purchased_product["BulletPoints"]).lower()
            or g_attr in purchased_product["Description"].lower()
        ):
            matched = True
        n += int(matched)
    return n / len(goal_attrs), n


def get_option_reward(
    purchased_options: Iterable[Any], goal_options: Iterable[Any]
) -> tuple[float | None, int]:
    """``(r_option, n_opt)``: goal options matched by a chosen option after colour folding.

    ``r_option`` is None when the goal has no options (upstream's convention).
    """
    purchased = [normalize_color(o) for o in purchased_options]
    goals = [normalize_color(o) for o in goal_options]
    n = 0
    for g in goals:
        for p in purchased:
            if fuzz.token_set_ratio(p, g) > _FUZZY_THRESHOLD:
                n += 1
                break
    return (n / len(goals) if goals else None), n


def get_reward(
    purchased_product: Mapping[str, Any],
    goal: Mapping[str, Any],
    price: float,
    options: Mapping[str, str],
    *,
    verbose: bool = False,
) -> float | tuple[float, dict[str, Any]]:
    """Upstream's total reward for buying ``purchased_product`` at ``price`` with ``options``.

    Args:
        purchased_product: A product dict with upstream's fields (``query``,
            ``product_category``, ``name``, ``Title``, ``BulletPoints``, ``Description``,
            ``Attributes``; optional precomputed ``title_nouns``).
        goal: A goal dict with upstream's fields (``query``, ``product_category``,
            ``name``, ``attributes``, ``goal_options`` as a list or dict, ``price_upper``;
            optional ``name_nouns``).
        price: The price paid (for a price range, the sampled price upstream uses).
        options: Chosen options, ``{option name: value}``.
        verbose: Also return upstream's breakdown (``r_type``, ``r_att``, ``w_att``,
            ``query_match``, ``category_match``, ``title_score``, ``r_option``,
            ``w_option``, ``r_price``, ``w_price``).

    Returns:
        The reward in [0, 1], or ``(reward, info)`` when ``verbose``.
    """
    r_type = get_type_reward(purchased_product, goal)
    # Upstream leaves r_price None (and its sum would fail) for a bound <= 0; count 0.
    r_price = (price <= goal["price_upper"]) if goal["price_upper"] > 0 else None
    r_att, n_att = get_attribute_reward(purchased_product, goal)
    goal_options = goal["goal_options"]
    # Upstream passes dict goal options as (name, value) items; kept for fidelity.
    g_opts = list(goal_options.items()) if isinstance(goal_options, Mapping) else goal_options
    r_option, n_opt = get_option_reward(list(options.values()), g_opts)
    denom = len(goal["attributes"]) + len(goal_options) + 1
    total = (n_att + n_opt + int(bool(r_price))) / denom * r_type["r_type"]
    if not verbose:
        return total
    info: dict[str, Any] = {
        "r_type": r_type["r_type"],
        "r_att": r_att,
        "w_att": len(goal["attributes"]) / denom,
        "query_match": r_type["query_match"],
        "category_match": r_type["category_match"],
        "title_score": r_type["title_score"],
    }
    if r_option is not None:
        info["r_option"] = r_option
        info["w_option"] = len(goal_options) / denom
    if r_price is not None:
        info["r_price"] = bool(r_price)
        info["w_price"] = 1 / denom
    return total, info
