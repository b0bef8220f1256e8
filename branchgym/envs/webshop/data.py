"""Catalogs: loading upstream's files, product prices, goals and their splits.

A :class:`Catalog` is immutable and shared: every env built from the same files (or the
same generated catalog) gets the same object from a process-wide cache, so snapshots
never copy products, goals or the search index. Loading follows upstream
``engine/engine.py:load_products`` and ``engine/goal.py:get_human_goals`` field by field;
two things differ on purpose, both for reproducibility: product prices in a range and
goal price bounds are drawn from a seeded ``random.Random``, never the global RNG.

Where the data comes from, in order: the ``data_dir`` argument, the
``BRANCHGYM_WEBSHOP_DATA`` environment variable, else a generated catalog written on
first use under :func:`~branchgym.envs.webshop.paths.cache_dir` (``$BRANCHGYM_CACHE`` or
``~/.cache/branchgym``).
Which files of a folder: ``data="small"``/``"full"`` (upstream's two releases,
:data:`PRESETS`) or explicit names; without either, the folder must hold one products
file and one attributes file of the same release, else a :class:`DataError` lists what
it found (never a silent choice, never a small attributes file under the full catalog).

This module is a little over 600 lines: loading, file resolution, prices and goals follow
upstream's ``engine.py``/``goal.py`` field by field, and keeping them together keeps that
correspondence readable.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import re
import threading
from collections.abc import Mapping
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

from branchgym.envs.webshop.generate import GENERATOR_VERSION, write_catalog
from branchgym.envs.webshop.paths import cache_dir
from branchgym.envs.webshop.reward import PRICE_RANGE
from branchgym.error import DataError

__all__ = [
    "Catalog",
    "HUMAN_FILE",
    "PRESETS",
    "SPLITS",
    "GOAL_SHUFFLE_SEED",
    "clear_catalog_cache",
    "load_catalog",
    "generated_dir",
    "resolve_data_dir",
]

#: Upstream shuffles the goal list with ``random.seed(233)`` before splitting.
GOAL_SHUFFLE_SEED = 233
#: Goal index ranges of upstream's splits (``baseline_models/env.py``): test, eval, train.
#: Upstream applies them only when ``num_products`` is unset (its ``--num``); with
#: ``num_products`` set, every split is all goals. ``agent_test`` is the common agent
#: convention (ReAct-style evaluations: goals 0-499, the ``fixed_0``..``fixed_499``
#: sessions), whatever the data; ``all`` is every goal.
SPLITS: dict[str, tuple[int, int | None]] = {
    "test": (0, 500),
    "eval": (500, 1500),
    "train": (1500, None),
    "all": (0, None),
    "agent_test": (0, 500),
}
_UPSTREAM_SPLITS = ("test", "eval", "train")
_REQUIRED_KEYS = ("asin", "name", "category", "query", "product_category")


def generated_dir(n_products: int, seed: int) -> Path:
    """The folder of the generated catalog of ``n_products`` products and ``seed``."""
    return cache_dir() / "webshop" / f"generated-v{GENERATOR_VERSION}-n{n_products}-s{seed}"


def resolve_data_dir(data_dir: str | os.PathLike | None) -> Path | None:
    """``data_dir``, else ``$BRANCHGYM_WEBSHOP_DATA``, else None (use the generated catalog)."""
    if data_dir is None:
        data_dir = os.environ.get("BRANCHGYM_WEBSHOP_DATA") or None
    if data_dir is None:
        return None
    path = Path(data_dir).expanduser()
    if not path.is_dir():
        raise DataError(
            f"WebShop data folder {str(path)!r} does not exist or is not a folder. Point "
            "data_dir (or BRANCHGYM_WEBSHOP_DATA) at the folder holding items_shuffle*.json, "
            "items_ins_v2*.json and items_human_ins.json from the WebShop data release, or "
            "leave both unset to use the generated catalog."
        )
    return path


@dataclasses.dataclass(frozen=True, eq=False)
class Catalog:
    """Products, prices and goals of one data source; immutable and shared between envs.

    Attributes:
        products: Product dicts with upstream's loaded fields (``asin``, ``Title``,
            ``name``, ``query``, ``category``, ``product_category``, ``Description``,
            ``BulletPoints``, ``Price``, ``pricing``, ``options``, ``Attributes``,
            ``Rating``, ``Reviews``, ``MainImage``, ...). Treat them as read-only.
        asin_index: ASIN -> position in ``products``.
        prices: The price paid for each product (the reward's ``price``).
        goals: Goal dicts with upstream's fields, shuffled with seed 233.
        fingerprint: Stable hash of the source and the loading options.
        source: Where the data came from (a folder, or ``generated``).
        human_goals: Whether goals come from human instructions (else synthetic).
        num_products: The ``num_products`` it was loaded with (upstream's ``--num``,
            which decides whether the splits apply).
        files: Names of the products and attributes files used.
    """

    products: tuple[dict[str, Any], ...]
    asin_index: Mapping[str, int]
    prices: tuple[float, ...]
    goals: tuple[dict[str, Any], ...]
    fingerprint: str
    source: str
    human_goals: bool
    num_products: int | None = None
    files: tuple[str, ...] = ()
    _lazy: dict[str, Any] = dataclasses.field(default_factory=dict, repr=False)

    def __len__(self) -> int:
        return len(self.products)

    def split_range(self, split: str) -> range:
        """Goal indices of ``split`` (``test``, ``eval``, ``train``, ``all``, ``agent_test``).

        As upstream's ``baseline_models/env.py``: with ``num_products`` set, ``test``,
        ``eval`` and ``train`` are every goal; otherwise goals [0, 500), [500, 1500) and
        [1500, end) of the seed-233 shuffled list.
        """
        if split not in SPLITS:
            raise DataError(
                f"unknown goal split {split!r}; use one of {', '.join(map(repr, SPLITS))}."
            )
        lo, hi = SPLITS[split]
        if split in _UPSTREAM_SPLITS and self.num_products is not None:
            lo, hi = SPLITS["all"]
        n = len(self.goals)
        r = range(min(lo, n), n if hi is None else min(hi, n))
        if len(r) == 0:
            raise DataError(
                f"the {split!r} split is empty: this catalog has {n} goals and upstream's "
                f"{split!r} split is goals[{lo}:{'' if hi is None else hi}]. Use a larger "
                "catalog, or split='all'."
            )
        return r

    @property
    def index(self) -> Any:
        """The BM25 search index (built or loaded from the disk cache on first use)."""
        idx = self._lazy.get("index")
        if idx is None:
            with _LOCK:
                idx = self._lazy.get("index")
                if idx is None:
                    from branchgym.envs.webshop.search import SearchIndex

                    idx = SearchIndex.for_catalog(self)
                    self._lazy["index"] = idx
        return idx


# ------------------------------------------------------------------------- loading

_CACHE: dict[tuple, Catalog] = {}
_LOCK = threading.RLock()


def load_catalog(
    data_dir: str | os.PathLike | None = None,
    *,
    num_products: int | None = None,
    generated_products: int = 1000,
    generator_seed: int = 0,
    price_seed: int = 0,
    human_goals: bool = True,
    products_file: str | None = None,
    attributes_file: str | None = None,
    data: str | None = None,
    human_file: str | None = None,
) -> Catalog:
    """Load (or fetch from the process cache) the catalog these arguments describe.

    Args:
        data_dir: Folder with the upstream files; default ``$BRANCHGYM_WEBSHOP_DATA``, else
            the generated catalog.
        num_products: Keep only the first N products of the products file (upstream's
            ``num_products``; its files are pre-shuffled).
        generated_products: Size of the generated catalog (when no data folder is given).
        generator_seed: Seed of the generated catalog.
        price_seed: Seed of the price draws (products priced as a range, goal bounds).
        human_goals: Goals from ``items_human_ins.json`` (True, upstream's benchmark
            setting) or synthetic goals from ``items_ins_v2*.json`` (False).
        products_file: Products file name inside the folder. Alone, it is paired with its
            release's attributes file (or the folder's only ``items_ins_v2*.json``).
        attributes_file: Attributes file name inside the folder (likewise).
        data: Upstream release preset: ``"small"`` (``items_shuffle_1000.json`` +
            ``items_ins_v2_1000.json``) or ``"full"`` (``items_shuffle.json`` +
            ``items_ins_v2.json``). Without it or file names, the folder must hold exactly
            one products and one attributes file of the same release.
        human_file: Human-instructions file name (default ``items_human_ins.json``).

    Raises:
        DataError: a folder or file is missing, unreadable or malformed.
    """
    path = resolve_data_dir(data_dir)
    if path is None:
        path = generated_dir(generated_products, generator_seed)
        if not (path / "items_shuffle.json").exists():
            write_catalog(path, generated_products, generator_seed)
        source = "generated"
    else:
        source = str(path)
    files = _resolve_files(path, data, products_file, attributes_file, human_file, human_goals)
    stamp = tuple((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files.values() if f)
    key = (str(path.resolve()), stamp, num_products, price_seed, human_goals)
    with _LOCK:
        cat = _CACHE.get(key)
        if cat is None:
            cat = _load(files, source, num_products, price_seed, human_goals)
            _CACHE[key] = cat
        return cat


def clear_catalog_cache() -> None:
    """Forget the catalogs loaded in this process (their memory is freed once unused)."""
    with _LOCK:
        _CACHE.clear()


#: Upstream's data releases: ``setup.sh -d small`` (1,000 products) and ``-d all``.
PRESETS: dict[str, tuple[str, str]] = {
    "small": ("items_shuffle_1000.json", "items_ins_v2_1000.json"),
    "full": ("items_shuffle.json", "items_ins_v2.json"),
}
HUMAN_FILE = "items_human_ins.json"


def _resolve_files(
    path: Path,
    preset: str | None,
    products_file: str | None,
    attributes_file: str | None,
    human_file: str | None,
    human_goals: bool,
) -> dict[str, Path | None]:
    """Choose the products/attributes/human files in ``path``; refuse any ambiguity.

    An explicit ``preset`` or file name wins; otherwise the folder must hold exactly one
    products file and one attributes file of the same release (or one custom pair).
    """
    found_p = sorted(f.name for f in path.glob("items_shuffle*.json"))
    found_a = sorted(f.name for f in path.glob("items_ins_v2*.json"))
    seen = f"found products files {found_p or 'none'} and attributes files {found_a or 'none'}"

    def need(name: str, what: str) -> Path:
        f = path / name
        if not f.is_file():
            raise DataError(
                f"{what} file {str(f)!r} does not exist ({seen} in {str(path)!r}); check the "
                "name, or download it with upstream's setup.sh (-d small / -d all)."
            )
        return f

    def partner(given: str, side: int, found: list[str]) -> str:
        """The other file of ``given``'s release (side 0: ``given`` is the products file)."""
        pre = _preset_of(given, side)
        if pre is not None:
            return PRESETS[pre][1 - side]
        if len(found) == 1:
            return found[0]
        kinds = ("products", "attributes")
        raise DataError(
            f"{kinds[side]}_file={given!r} has no matching {kinds[1 - side]} file ({seen}); "
            f"name it with {kinds[1 - side]}_file=."
        )

    if preset is not None:
        if preset not in PRESETS:
            raise DataError(
                f"unknown WebShop data preset {preset!r}; use 'small' (items_shuffle_1000.json "
                "+ items_ins_v2_1000.json) or 'full' (items_shuffle.json + items_ins_v2.json), "
                "or name the files with products_file=/attributes_file=."
            )
        if products_file is not None or attributes_file is not None:
            raise DataError(
                f"data={preset!r} names the files already; pass either data= or "
                "products_file=/attributes_file=, not both."
            )
        products_file, attributes_file = PRESETS[preset]
    elif products_file is None and attributes_file is None:
        complete = [k for k, (p, a) in PRESETS.items() if p in found_p and a in found_a]
        if len(found_p) == 1 and len(found_a) == 1:
            p, a = found_p[0], found_a[0]
            mixed = {_preset_of(p, 0), _preset_of(a, 1)} >= {"small", "full"}
            if mixed:
                raise DataError(
                    f"{str(path)!r} pairs {p} with {a}, files of different releases (products "
                    "outside the attributes file would get no attributes); add the matching "
                    f"file, or confirm the pair with products_file={p!r}, attributes_file={a!r}."
                )
            products_file, attributes_file = p, a
        elif not found_p or not found_a:
            raise DataError(
                f"{str(path)!r} is not a complete WebShop data folder: {seen}. It needs "
                "items_shuffle*.json, items_ins_v2*.json and items_human_ins.json (the WebShop "
                "data release), or leave data_dir unset to use the generated catalog."
            )
        else:
            hint = f" (complete releases here: {', '.join(complete)})" if complete else ""
            raise DataError(
                f"{str(path)!r} holds several WebShop data files: {seen}{hint}. Choose with "
                "data='small' or data='full', or name both files with products_file= and "
                "attributes_file=."
            )
    elif attributes_file is None:
        attributes_file = partner(products_file, 0, found_a)
    elif products_file is None:
        products_file = partner(attributes_file, 1, found_p)
    files: dict[str, Path | None] = {
        "products": need(products_file, "products"),
        "attributes": need(attributes_file, "attributes"),
        "human": path / (human_file or HUMAN_FILE),
        "reviews": path / "reviews.json" if (path / "reviews.json").is_file() else None,
    }
    if human_goals and not files["human"].is_file():  # type: ignore[union-attr]
        raise DataError(
            f"{str(files['human'])!r} is missing: human-instruction goals need "
            "items_human_ins.json from the WebShop data release (or pass human_goals=False "
            "for synthetic goals from items_ins_v2*.json)."
        )
    if not human_goals:
        files["human"] = None
    return files


def _preset_of(name: str, which: int) -> str | None:
    """The release whose products (0) or attributes (1) file is called ``name``."""
    return next((k for k, files in PRESETS.items() if files[which] == name), None)


def _read_json(path: Path, expect: type) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except OSError as exc:
        raise DataError(
            f"cannot read {str(path)!r}: {exc}. Check the path and permissions."
        ) from exc
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DataError(
            f"{str(path)!r} is not valid JSON ({exc}); the file is truncated or corrupt. "
            "Download it again from the WebShop data release."
        ) from exc
    if not isinstance(obj, expect):
        raise DataError(
            f"{str(path)!r} holds a JSON {type(obj).__name__}, expected a "
            f"{'list of products' if expect is list else 'object keyed by ASIN'}; is it the "
            "right file?"
        )
    return obj


def _malformed(path: Path, i: int, what: str) -> DataError:
    return DataError(f"{str(path)!r}, product #{i}: {what}. The file does not follow the schema.")


def parse_pricing(pricing: Any) -> list[float]:
    """Upstream's price parsing: ``"$12.99"`` -> [12.99]; ``"$9 - $14.5"`` -> [9.0, 14.5].

    Everything but digits and dots is dropped from each ``$``-separated piece; a missing
    or empty price becomes [100.0], as upstream. Lists of numbers are accepted too.
    """
    if pricing is None or pricing == "" or pricing == []:
        return [100.0]
    if isinstance(pricing, list | tuple):
        return [float(p) for p in pricing[:2]]
    if not isinstance(pricing, str):
        raise ValueError(f"pricing must be a string like '$12.99', got {pricing!r}")
    out = []
    for piece in pricing.split("$")[1:]:
        digits = re.sub(r"[^\d.]", "", piece)
        try:
            out.append(float(Decimal(digits)))
        except InvalidOperation as exc:
            raise ValueError(f"cannot parse price {piece!r} in {pricing!r}") from exc
    if not out:
        raise ValueError(f"no '$' price in {pricing!r}")
    return out[:2]


def _load(
    files: dict[str, Path | None],
    source: str,
    num_products: int | None,
    price_seed: int,
    human_goals: bool,
) -> Catalog:
    products_path = Path(files["products"])  # type: ignore[arg-type]  # always resolved
    raw = _read_json(products_path, list)
    attributes = _read_json(files["attributes"], dict)  # type: ignore[arg-type]
    human = _read_json(files["human"], dict) if files["human"] else {}
    reviews: dict[str, tuple[list, Any]] = {}
    if files["reviews"] is not None:
        for r in _read_json(files["reviews"], list):
            if isinstance(r, dict) and "asin" in r:
                reviews[r["asin"]] = (r.get("reviews") or [], r.get("average_rating", "N.A."))
    if num_products is not None:
        raw = raw[:num_products]

    products: list[dict[str, Any]] = []
    seen: set[str] = set()
    for i, p in enumerate(raw):
        if not isinstance(p, dict):
            raise _malformed(products_path, i, f"expected an object, got {type(p).__name__}")
        missing = [k for k in _REQUIRED_KEYS if k not in p]
        if missing:
            raise _malformed(products_path, i, f"missing {', '.join(missing)}")
        asin = p["asin"]
        if not isinstance(asin, str) or asin == "nan" or len(asin) > 10 or asin in seen:
            continue  # upstream skips these rows
        seen.add(asin)
        products.append(_product(p, i, products_path, attributes, human, reviews, human_goals))
    if not products:
        raise DataError(f"{str(products_path)!r} holds no usable product.")

    prices = _prices(products, price_seed)
    goals = (
        _human_goals(products, prices, price_seed)
        if human_goals
        else _synthetic_goals(products, prices, price_seed)
    )
    random.Random(GOAL_SHUFFLE_SEED).shuffle(goals)
    return Catalog(
        products=tuple(products),
        asin_index={p["asin"]: i for i, p in enumerate(products)},
        prices=tuple(prices),
        goals=tuple(goals),
        fingerprint=_fingerprint(products, prices, goals),
        source=source,
        human_goals=human_goals,
        num_products=num_products,
        files=tuple(f.name for f in (files["products"], files["attributes"]) if f),
    )


def _fingerprint(products: list[dict], prices: list[float], goals: list[dict]) -> str:
    """A content hash (not paths or file times), so snapshots travel between machines."""
    h = hashlib.blake2b(digest_size=16)
    for p, price in zip(products, prices, strict=True):
        opts = sorted(p["options"].items())
        h.update(f"{p['asin']}|{p['Title']}|{price!r}|{opts}|{p['Attributes']}\n".encode())
    for g in goals:
        h.update(f"{g['asin']}|{g['instruction_text']}|{g['goal_options']}\n".encode())
    return h.hexdigest()


def _product(
    p: dict[str, Any],
    i: int,
    path: Path,
    attributes: dict[str, Any],
    human: dict[str, Any],
    reviews: dict[str, tuple[list, Any]],
    human_goals: bool,
) -> dict[str, Any]:
    asin = p["asin"]
    out: dict[str, Any] = {
        "asin": asin,
        "name": p["name"],
        "category": p["category"],
        "query": str(p["query"]).lower().strip(),
        "product_category": p["product_category"],
        "Title": p["name"],
        "Description": p.get("full_description") or "",
    }
    bullets = p.get("small_description")
    out["BulletPoints"] = (
        [str(b) for b in bullets] if isinstance(bullets, list) else [str(bullets or "")]
    )
    revs, rating = reviews.get(asin, ([], "N.A."))
    out["Reviews"] = [_review(r) for r in revs]
    out["Rating"] = rating
    try:
        pricing = parse_pricing(p.get("pricing"))
    except ValueError as exc:
        raise _malformed(path, i, str(exc)) from exc
    out["pricing"] = pricing
    out["Price"] = f"${pricing[0]}" if len(pricing) == 1 else f"${pricing[0]} to ${pricing[1]}"

    options: dict[str, list[str]] = {}
    custom = p.get("customization_options") or {}
    if not isinstance(custom, dict):
        raise _malformed(path, i, "customization_options must be an object {name: [values]}")
    for name, contents in custom.items():
        if contents is None:
            continue
        try:
            options[name.lower()] = [
                str(c["value"]).strip().replace("/", " | ").lower() for c in contents
            ]
        except (TypeError, KeyError) as exc:
            raise _malformed(path, i, f"option {name!r} needs a list of {{'value': ...}}") from exc
    out["options"] = options

    entry = attributes.get(asin)
    has_attrs = isinstance(entry, dict) and "attributes" in entry
    out["Attributes"] = list(entry["attributes"]) if has_attrs else ["DUMMY_ATTR"]
    if human_goals:
        if asin in human:
            out["instructions"] = human[asin]
    elif isinstance(entry, dict):
        out["instruction_text"] = entry.get("instruction")
        out["instruction_attributes"] = entry.get("instruction_attributes")
    images = p.get("images") or [""]
    out["MainImage"] = images[0] if isinstance(images, list) else str(images)
    if isinstance(p.get("title_nouns"), list):  # precomputed by the generator
        out["title_nouns"] = tuple(str(n).lower() for n in p["title_nouns"])
    return out


def _review(r: Any) -> dict[str, Any]:
    r = dict(r) if isinstance(r, dict) else {}
    if "score" not in r:
        r["score"] = r.pop("stars", 0)
    r["body"] = r.pop("review", "") if "body" not in r else r["body"]
    r.setdefault("title", "")
    return r


def _prices(products: list[dict[str, Any]], seed: int) -> list[float]:
    """Upstream ``generate_product_prices``, with a seeded RNG for ranges."""
    rng = random.Random(seed)
    out = []
    for p in products:
        pricing = p["pricing"]
        if not pricing:
            out.append(100.0)
        elif len(pricing) == 1:
            out.append(float(pricing[0]))
        else:
            out.append(rng.uniform(*pricing[:2]))
    return out


def _price_bound(price: float, rng: random.Random) -> tuple[float, str]:
    """Upstream's bound: the larger of two of the four grid prices above ``price``."""
    price_range = [p for p in PRICE_RANGE if p > price][:4]
    if len(price_range) >= 2:
        _, upper = sorted(rng.sample(price_range, 2))
        return upper, f", and price lower than {upper:.2f} dollars"
    return 1000000, ""


def _human_goals(
    products: list[dict[str, Any]], prices: list[float], seed: int
) -> list[dict[str, Any]]:
    rng = random.Random(seed + 1)
    goals = []
    for p, price in zip(products, prices, strict=True):
        for ins in p.get("instructions", ()):
            attrs = ins.get("instruction_attributes") or []
            if not attrs:
                continue  # upstream skips goals without attributes
            upper, price_text = _price_bound(price, rng)
            goals.append(
                _goal(p, str(ins["instruction"]).strip(".") + price_text, attrs, upper)
                | {"goal_options": list(ins.get("instruction_options") or []), "weight": 1}
            )
    return goals


def _synthetic_goals(
    products: list[dict[str, Any]], prices: list[float], seed: int
) -> list[dict[str, Any]]:
    import itertools
    from collections import defaultdict

    rng = random.Random(seed + 1)
    goals, counts = [], defaultdict(int)
    for p, price in zip(products, prices, strict=True):
        if p.get("instruction_text") is None:
            continue
        attrs = p.get("instruction_attributes") or []
        if not attrs:
            continue
        upper, price_text = _price_bound(price, rng)
        names = sorted(p["options"])
        for combo in itertools.product(*(p["options"][n] for n in names)):
            goal_options = dict(zip(names, combo, strict=True))
            opt = ", and ".join(f"{k}: {v}" for k, v in goal_options.items())
            text = f"{p['instruction_text']}{' with ' + opt if opt else ''}{price_text}"
            goals.append(_goal(p, text, attrs, upper) | {"goal_options": goal_options})
            for a in attrs:
                counts[a] += 1
    for g in goals:  # upstream's sampling weight: rarer attributes weigh more
        g["weight"] = sum(1.0 / counts[a] for a in g["attributes"]) / len(g["attributes"])
    return goals


def _goal(p: dict[str, Any], text: str, attrs: list, upper: float) -> dict[str, Any]:
    goal = {
        "asin": p["asin"],
        "category": p["category"],
        "query": p["query"],
        "name": p["name"],
        "product_category": p["product_category"],
        "instruction_text": text,
        "attributes": list(attrs),
        "price_upper": upper,
    }
    if "title_nouns" in p:
        goal["name_nouns"] = p["title_nouns"]
    return goal
