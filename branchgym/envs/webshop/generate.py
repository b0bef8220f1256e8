"""A seeded generator of WebShop catalogs in upstream's three file schemas.

The real WebShop data (1.18 M scraped products, 12 k crowd-sourced instructions) is
licensed for non-commercial research and is never shipped here. Tests and demos use a
generated catalog written in exactly the upstream schemas, so the same loader reads
both:

* ``items_shuffle.json``: a list of raw products (``asin``, ``name``, ``category``,
  ``query``, ``product_category``, ``full_description``, ``small_description``,
  ``pricing`` as a ``"$x"`` or ``"$x - $y"`` string, ``images``,
  ``customization_options`` as ``{name: [{"value", "image"}]}``), plus a
  ``title_nouns`` list that upstream ignores and the type reward uses instead of spaCy;
* ``items_ins_v2.json``: ``{asin: {"attributes", "instruction", "instruction_attributes"}}``;
* ``items_human_ins.json``: ``{asin: [{"asin", "instruction", "attributes", "options",
  "instruction_attributes", "instruction_options", "assignment_id", "worker_id"}]}``;
* ``reviews.json`` (optional upstream file): ``[{"asin", "average_rating", "reviews"}]``.

Products come from 20 kinds in upstream's five top-level categories (beauty, food,
fashion, furniture, electronics), each with its own Amazon-style category path, brands,
attribute phrases, option axes and price range. Instructions read like the human ones
("i am looking for a sulfate free shampoo with tea tree scent in 16.9 fl oz size").
Everything is a function of ``(n_products, seed)`` and :data:`GENERATOR_VERSION`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import string
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tqdm import tqdm

__all__ = ["GENERATOR_VERSION", "KINDS", "Kind", "generate_catalog", "write_catalog"]

#: Bump when the generated content changes, so caches regenerate.
GENERATOR_VERSION = 1


@dataclasses.dataclass(frozen=True)
class Kind:
    """One kind of product: what a scraping query returned upstream."""

    query: str
    category: str
    product_category: str
    heads: tuple[str, ...]  # head phrases closing the title ("Tea Tree Shampoo")
    attributes: tuple[str, ...]  # lowercase attribute phrases (items_ins_v2 "attributes")
    options: tuple[tuple[str, tuple[str, ...]], ...]  # option axes and their values
    price: tuple[float, float]
    uses: tuple[str, ...]  # what it is for, for bullets and descriptions


_COLORS = (
    "black", "white", "navy blue", "heather gray", "burgundy", "olive green", "beige",
    "light pink", "royal blue", "charcoal", "khaki", "dark brown", "ivory", "teal",
)  # fmt: skip
_APPAREL_SIZES = ("x-small", "small", "medium", "large", "x-large", "xx-large")

KINDS: tuple[Kind, ...] = (
    # --------------------------------------------------------------------- beauty
    Kind(
        "shampoo",
        "beauty",
        "Beauty & Personal Care › Hair Care › Shampoo & Conditioner › Shampoos",
        ("Shampoo", "Daily Shampoo", "Clarifying Shampoo", "Moisturizing Shampoo"),
        ("sulfate free", "paraben free", "tea tree", "natural ingredients", "dry hair",
         "hair growth", "color safe", "argan oil", "dandruff control", "cruelty free",
         "curly hair", "volumizing"),
        (("size", ("8.4 fl oz (pack of 1)", "16.9 fl oz (pack of 1)", "8.4 fl oz (pack of 2)")),
         ("scent", ("tea tree", "lavender", "coconut", "unscented"))),
        (6.0, 38.0),
        ("daily washing", "oily scalp", "salon results"),
    ),
    Kind(
        "deodorant",
        "beauty",
        "Beauty & Personal Care › Personal Care › Deodorants & Antiperspirants › Deodorants",
        ("Deodorant", "Deodorant Stick", "Natural Deodorant"),
        ("aluminum free", "long lasting", "sensitive skin", "baking soda free",
         "natural ingredients", "cruelty free", "travel size", "fresh scent", "vegan",
         "odor protection"),
        (("scent", ("citrus", "lavender", "cedarwood", "unscented", "eucalyptus")),
         ("size", ("2.65 ounce (pack of 1)", "2.65 ounce (pack of 2)", "3 ounce (pack of 3)"))),
        (5.0, 28.0),
        ("everyday use", "workouts", "hot days"),
    ),
    Kind(
        "lipstick",
        "beauty",
        "Beauty & Personal Care › Makeup › Lips › Lipstick",
        ("Lipstick", "Matte Lipstick", "Liquid Lipstick", "Cream Lipstick"),
        ("long lasting", "matte finish", "waterproof", "moisturizing", "cruelty free",
         "vitamin e", "high pigment", "smudge proof", "paraben free", "vegan"),
        (("color", ("ruby red", "nude beige", "rose pink", "plum", "coral", "mauve", "wine")),),
        (4.0, 32.0),
        ("date night", "office looks", "weddings"),
    ),
    Kind(
        "hair extension",
        "beauty",
        "Beauty & Personal Care › Hair Care › Hair Extensions, Wigs & Accessories › Extensions",
        ("Clip in Hair Extensions", "Hair Extensions", "Ponytail Hair Extensions"),
        ("natural looking", "human hair", "heat resistant", "easy to apply",
         "long lasting", "straight hair", "wavy hair", "synthetic fiber", "thick hair",
         "reusable"),
        (("color", ("jet black", "dark brown", "light brown", "blonde", "auburn")),
         ("size", ("16 inch", "20 inch", "24 inch"))),
        (12.0, 120.0),
        ("extra volume", "special occasions", "daily styling"),
    ),
    # ----------------------------------------------------------------------- food
    Kind(
        "coffee",
        "food",
        "Grocery & Gourmet Food › Beverages › Coffee, Tea & Cocoa › Coffee › Ground Coffee",
        ("Ground Coffee", "Whole Bean Coffee", "Coffee"),
        ("medium roast", "dark roast", "organic", "fair trade", "low acid", "decaf",
         "single origin", "arabica beans", "gluten free", "kosher"),
        (("size", ("12 ounce (pack of 1)", "2 pound (pack of 1)", "12 ounce (pack of 3)")),
         ("flavor name", ("original", "vanilla", "hazelnut", "mocha", "caramel"))),
        (7.0, 45.0),
        ("morning brews", "espresso machines", "cold brew"),
    ),
    Kind(
        "potato chips",
        "food",
        "Grocery & Gourmet Food › Snacks & Sweets › Chips & Crisps › Potato Chips",
        ("Potato Chips", "Kettle Chips", "Chips Variety Pack"),
        ("gluten free", "non gmo", "kettle cooked", "low sodium", "vegan",
         "individually wrapped", "no artificial flavors", "dairy free", "nut free",
         "variety pack"),
        (("flavor name", ("sea salt", "barbecue", "sour cream and onion", "salt and vinegar",
                          "jalapeno")),
         ("size", ("1 ounce (pack of 24)", "2 ounce (pack of 12)", "8 ounce (pack of 4)"))),
        (4.0, 36.0),
        ("lunch boxes", "parties", "road trips"),
    ),
    Kind(
        "protein bar",
        "food",
        "Grocery & Gourmet Food › Snacks & Sweets › Snack Bars › Protein Bars",
        ("Protein Bars", "Protein Snack Bars", "Whey Protein Bars"),
        ("high protein", "low sugar", "gluten free", "keto friendly", "plant based",
         "non gmo", "soy free", "individually wrapped", "dairy free", "high fiber"),
        (("flavor name", ("chocolate chip", "peanut butter", "cookie dough", "berry",
                          "salted caramel")),
         ("size", ("12 count (pack of 1)", "12 count (pack of 2)", "24 count (pack of 1)"))),
        (9.0, 48.0),
        ("post workout recovery", "busy mornings", "hiking"),
    ),
    Kind(
        "herbal tea",
        "food",
        "Grocery & Gourmet Food › Beverages › Coffee, Tea & Cocoa › Tea › Herbal",
        ("Herbal Tea", "Tea Bags", "Loose Leaf Tea"),
        ("caffeine free", "organic", "non gmo", "kosher", "gluten free", "individually wrapped",
         "sugar free", "relaxing blend", "usda organic", "biodegradable bags"),
        (("flavor name", ("chamomile", "peppermint", "ginger", "hibiscus", "lemon balm")),
         ("size", ("20 count (pack of 1)", "20 count (pack of 6)", "40 count (pack of 2)"))),
        (4.0, 30.0),
        ("bedtime", "afternoon breaks", "cold evenings"),
    ),
    # -------------------------------------------------------------------- fashion
    Kind(
        "running shoes",
        "fashion",
        "Clothing, Shoes & Jewelry › Men › Shoes › Athletic › Running › Road Running",
        ("Running Shoes", "Road Running Shoes", "Trail Running Shoes", "Athletic Running Shoes"),
        ("lightweight", "breathable mesh", "rubber sole", "arch support", "non slip",
         "memory foam", "wide toe box", "lace up", "shock absorbing", "machine washable"),
        (("color", _COLORS[:8]),
         ("size", ("7", "7.5", "8", "8.5", "9", "9.5", "10", "10.5", "11", "12"))),
        (25.0, 160.0),
        ("daily runs", "gym training", "long walks"),
    ),
    Kind(
        "hoodie",
        "fashion",
        "Clothing, Shoes & Jewelry › Women › Clothing › Fashion Hoodies & Sweatshirts",
        ("Hoodie", "Pullover Hoodie", "Zip Up Hoodie", "Fleece Hoodie"),
        ("long sleeve", "machine wash", "soft fleece", "relaxed fit", "drawstring hood",
         "kangaroo pocket", "cotton blend", "ribbed cuffs", "oversized", "pullover"),
        (("color", _COLORS), ("size", _APPAREL_SIZES)),
        (15.0, 70.0),
        ("cool mornings", "lounging at home", "casual outings"),
    ),
    Kind(
        "jeans",
        "fashion",
        "Clothing, Shoes & Jewelry › Men › Clothing › Jeans",
        ("Jeans", "Slim Fit Jeans", "Straight Leg Jeans", "Denim Jeans"),
        ("slim fit", "straight leg", "stretch denim", "machine wash", "button closure",
         "relaxed fit", "classic five pocket", "high waist", "cotton blend", "button fly"),
        (("color", ("dark wash", "light wash", "black", "stonewash", "indigo")),
         ("size", ("30w x 30l", "32w x 30l", "32w x 32l", "34w x 32l", "36w x 32l"))),
        (20.0, 90.0),
        ("everyday wear", "weekend trips", "casual fridays"),
    ),
    Kind(
        "dress",
        "fashion",
        "Clothing, Shoes & Jewelry › Women › Clothing › Dresses › Casual",
        ("Dress", "Maxi Dress", "Wrap Dress", "Summer Dress"),
        ("short sleeve", "v neck", "flowy", "machine wash", "high waist", "floral print",
         "with pockets", "knee length", "lightweight fabric", "elastic waist"),
        (("color", _COLORS[:10]), ("size", _APPAREL_SIZES[:5])),
        (18.0, 85.0),
        ("beach vacations", "summer parties", "brunch with friends"),
    ),
    # ------------------------------------------------------------------ furniture
    Kind(
        "office chair",
        "furniture",
        "Home & Kitchen › Furniture › Home Office Furniture › Home Office Chairs › Desk Chairs",
        ("Office Chair", "Ergonomic Desk Chair", "Executive Office Chair", "Task Chair"),
        ("lumbar support", "adjustable height", "easy assembly", "breathable mesh",
         "swivel wheels", "padded armrests", "high back", "heavy duty", "tilt function",
         "pu leather"),
        (("color", ("black", "gray", "white", "blue", "brown")),),
        (45.0, 320.0),
        ("home offices", "long work days", "gaming setups"),
    ),
    Kind(
        "bookshelf",
        "furniture",
        "Home & Kitchen › Furniture › Living Room Furniture › Bookcases",
        ("Bookshelf", "Ladder Bookshelf", "Storage Bookshelf", "Corner Bookshelf"),
        ("easy assembly", "solid wood", "5 tier", "space saving", "industrial style",
         "metal frame", "anti tip", "open shelves", "rustic finish", "sturdy construction"),
        (("color", ("rustic brown", "black", "white", "walnut", "gray oak")),
         ("size", ("3 tier", "4 tier", "5 tier"))),
        (35.0, 260.0),
        ("living rooms", "home offices", "kids rooms"),
    ),
    Kind(
        "throw pillow",
        "furniture",
        "Home & Kitchen › Home Décor Products › Decorative Pillows, Inserts & Covers › Covers",
        ("Throw Pillow Covers", "Decorative Pillow Covers", "Square Pillow Covers"),
        ("double sided", "machine washable", "hidden zipper", "soft velvet", "set of 2",
         "linen blend", "farmhouse style", "boho design", "fade resistant", "insert included"),
        (("color", _COLORS[:10]),
         ("size", ("16 x 16 inch", "18 x 18 inch", "20 x 20 inch", "26 x 26 inch"))),
        (8.0, 45.0),
        ("sofas", "beds", "patio chairs"),
    ),
    Kind(
        "area rug",
        "furniture",
        "Home & Kitchen › Home Décor Products › Area Rugs, Runners & Pads › Area Rugs",
        ("Area Rug", "Shag Rug", "Vintage Area Rug", "Runner Rug"),
        ("non slip", "machine washable", "stain resistant", "low pile", "easy to clean",
         "pet friendly", "soft touch", "non shedding", "boho design", "modern abstract"),
        (("color", ("gray", "ivory", "navy blue", "multicolor", "beige", "teal")),
         ("size", ("2 x 3 ft", "5 x 7 ft", "8 x 10 ft", "2.6 x 8 ft runner"))),
        (20.0, 300.0),
        ("living rooms", "bedrooms", "hallways"),
    ),
    # ---------------------------------------------------------------- electronics
    Kind(
        "headphones",
        "electronics",
        "Electronics › Headphones, Earbuds & Accessories › Headphones › Over-Ear Headphones",
        ("Headphones", "Wireless Headphones", "Over Ear Headphones", "Bluetooth Headphones"),
        ("noise cancelling", "wireless bluetooth", "long battery life", "built in microphone",
         "foldable design", "fast charging", "deep bass", "memory foam ear cushions",
         "hands free", "usb c"),
        (("color", ("black", "white", "silver", "navy blue", "rose gold")),),
        (18.0, 250.0),
        ("travel", "office calls", "workouts"),
    ),
    Kind(
        "phone case",
        "electronics",
        "Cell Phones & Accessories › Cases, Holsters & Sleeves › Basic Cases",
        ("Phone Case", "Protective Phone Case", "Clear Phone Case", "Wallet Phone Case"),
        ("shockproof", "slim fit", "wireless charging compatible", "raised edges",
         "card holder", "anti scratch", "heavy duty", "kickstand", "tempered glass",
         "screen protector included"),
        (("color", ("black", "clear", "navy blue", "red", "pink", "green")),
         ("size", ("iphone 13", "iphone 14", "iphone 15", "galaxy s23"))),
        (6.0, 40.0),
        ("everyday protection", "drops", "outdoor trips"),
    ),
    Kind(
        "hdmi cable",
        "electronics",
        "Electronics › Television & Video › Accessories › Cables › HDMI Cables",
        ("HDMI Cable", "High Speed HDMI Cable", "Braided HDMI Cable"),
        ("4k", "high speed", "braided nylon", "gold plated", "ethernet", "8k",
         "hdr support", "durable", "tangle free", "arc support"),
        (("size", ("3 feet", "6 feet", "10 feet", "15 feet")),
         ("style", ("1 pack", "2 pack", "3 pack"))),
        (5.0, 35.0),
        ("home theaters", "gaming consoles", "laptops"),
    ),
    Kind(
        "power bank",
        "electronics",
        "Cell Phones & Accessories › Chargers & Power Adapters › Portable Power Banks",
        ("Power Bank", "Portable Power Bank", "Slim Power Bank"),
        ("fast charging", "usb c", "high capacity", "led display", "compact design",
         "dual output", "wireless charging", "airline approved", "solar panel", "slim design"),
        (("color", ("black", "white", "blue", "pink")),
         ("size", ("10000mah", "20000mah", "26800mah"))),
        (15.0, 90.0),
        ("travel", "camping", "emergencies"),
    ),
)  # fmt: skip

_BRAND_A = (
    "Verdant", "Northwind", "Lumen", "Harbor", "Maple", "Cobalt", "Aurora", "Summit",
    "Willow", "Ember", "Crescent", "Juniper", "Atlas", "Meadow", "Falcon", "Sierra",
    "Orchid", "Granite", "Pioneer", "Solace", "Halcyon", "Briar", "Tundra", "Copper",
)  # fmt: skip
_BRAND_B = (
    "Grove", "Labs", "Essentials", "Works", "Co", "Goods", "Home", "Studio", "Craft",
    "Supply", "Basics", "Collective", "Naturals", "Outfitters", "Trading", "Living",
)  # fmt: skip
_OPENERS = (
    "i need", "i am looking for", "i want", "find me", "i would like", "looking for",
    "i'm searching for", "get me", "i want to buy", "can you find",
)  # fmt: skip
_BULLETS = (
    "{A}: made for {use}, so it keeps up with your routine",
    "{A} design that customers love for {use}",
    "Thoughtfully made: {a} and built to last",
    "Why {brand}? {A}, tested for {use}",
    "Great gift idea: {a}, ready for {use}",
)  # fmt: skip
_DESCRIPTIONS = (
    "The {brand} {head} is {a1} and {a2}. Designed for {use}, it brings dependable "
    "quality to every day.",
    "Meet the {head} from {brand}: {a1}, {a2}, and made for {use}. Satisfaction "
    "guaranteed.",
    "{brand} {head}. {A1}. {A2}. A smart choice for {use}.",
)  # fmt: skip
_REVIEW_TITLES = ("Love it", "Works as described", "Good value", "Not bad", "Disappointed")
_REVIEW_BODIES = (
    "Exactly what I needed, would buy again.",
    "Quality is fine for the price.",
    "Arrived quickly and looks great.",
    "It does the job but could be better.",
    "Did not meet my expectations.",
)  # fmt: skip

# Nouns of the generated titles, by construction; spaCy would tag these NOUN/PROPN.
_NOUN_WORDS = frozenset(
    """shampoo deodorant stick lipstick color lip hair running whey hdmi extensions extension
    ponytail coffee bean chips variety pack protein bar bars snack tea bags leaf shoes shoe
    sneakers hoodie
    sweatshirt jeans denim dress chair desk office task bookshelf bookcase ladder shelf
    storage throw pillow covers cover cushion rug runner headphones headset phone case
    cable cord power bank charger battery tree oil ingredients growth control soda scent
    protection finish vitamin pigment fiber roast trade origin beans sodium flavors sugar
    fiber blend sole support foam toe box mesh sleeve fleece fit hood pocket cuffs leg
    waist closure fly neck print pockets fabric height assembly wheels armrests back duty
    function leather wood tier style frame shelves construction zipper velvet set linen
    design insert pile touch bass microphone ear cushions hands edges holder glass screen
    protector ethernet hdr arc capacity display output panel""".split()
)


def _asin(rng: random.Random, taken: set[str]) -> str:
    alphabet = string.ascii_uppercase + string.digits
    while True:
        asin = "B0" + "".join(rng.choice(alphabet) for _ in range(8))
        if asin not in taken:
            taken.add(asin)
            return asin


def _title_case(phrase: str) -> str:
    return " ".join(w if any(c.isdigit() for c in w) else w.capitalize() for w in phrase.split())


def _with_article(words: str) -> str:
    return ("an " if words[:1] in "aeiou" else "a ") + words


def _option_phrase(name: str, value: str, rng: random.Random) -> str:
    if name == "color":
        return rng.choice((f"in {value} color", f"in {value}", f"color {value}"))
    if name == "size":
        return rng.choice((f"in size {value}", f"in {value} size", f"size {value}"))
    if name == "flavor name":
        return rng.choice((f"in {value} flavor", f"with {value} flavor", f"{value} flavored"))
    return rng.choice((f"with {name} {value}", f"{name}: {value}"))


def _product(kind: Kind, rng: random.Random, taken: set[str]) -> tuple[dict, dict, list, dict]:
    asin = _asin(rng, taken)
    brand = f"{rng.choice(_BRAND_A)} {rng.choice(_BRAND_B)}"
    attrs = rng.sample(kind.attributes, rng.randint(3, 5))
    head = rng.choice(kind.heads)
    lead = rng.sample(attrs, 2)
    title = f"{brand} {_title_case(lead[0])} {head}, {_title_case(lead[1])}"
    options: dict[str, list[dict[str, Any]]] = {}
    for name, values in kind.options:
        if rng.random() < 0.85:  # most products offer every axis, some only a few
            k = rng.randint(2, min(5, len(values)))
            picked = sorted(rng.sample(range(len(values)), k))
            options[name] = [
                {"value": values[i], "image": f"images/{asin}_{name[:1]}{i}.jpg"} for i in picked
            ]
    if "size" in options and rng.random() < 0.5:
        title += f" - {_title_case(options['size'][0]['value'])}"
    lo, hi = kind.price
    price = round(rng.uniform(lo, hi), 2)
    if rng.random() < 0.2:
        pricing = f"${price:.2f} - ${round(price * rng.uniform(1.1, 1.5), 2):.2f}"
    else:
        pricing = f"${price:.2f}"
    uses = list(kind.uses)
    bullets = []
    for a in attrs:
        template = rng.choice(_BULLETS)
        bullets.append(template.format(A=a.capitalize(), a=a, use=rng.choice(uses), brand=brand))
    a1, a2 = rng.sample(attrs, 2)
    description = rng.choice(_DESCRIPTIONS).format(
        brand=brand,
        head=head.lower(),
        a1=a1,
        a2=a2,
        A1=a1.capitalize(),
        A2=a2.capitalize(),
        use=rng.choice(uses),
    )
    nouns = [w.lower() for w in brand.split()] + [
        t for t in (w.strip(",.-").lower() for w in title.split()) if t in _NOUN_WORDS
    ]
    raw = {
        "asin": asin,
        "name": title,
        "category": kind.category,
        "query": kind.query,
        "product_category": kind.product_category,
        "full_description": description,
        "small_description": bullets,
        "pricing": pricing,
        "images": [f"images/{asin}.jpg"],
        "customization_options": options,
        "brand": brand,
        "title_nouns": list(dict.fromkeys(nouns)),
    }
    synthetic = {
        "attributes": attrs,
        "instruction": f"{rng.choice(_OPENERS)} {_with_article(' and '.join(lead))} {kind.query}",
        "instruction_attributes": lead,
    }
    human = []
    for n in range(rng.choice((2, 2, 3, 3, 3))):
        ins_attrs = rng.sample(attrs, rng.randint(1, min(3, len(attrs))))
        chosen = {name: rng.choice(vals)["value"] for name, vals in options.items()}
        said = [(k, v) for k, v in chosen.items() if rng.random() < 0.8]
        noun = kind.query if rng.random() < 0.6 else head.lower()
        text = f"{rng.choice(_OPENERS)} {_with_article(', '.join(ins_attrs))} {noun}"
        if said:
            text += " " + " and ".join(_option_phrase(k, v, rng) for k, v in said)
        human.append(
            {
                "asin": asin,
                "instruction": text,
                "attributes": attrs,
                "options": [f"{k}: {v}" for k, v in chosen.items()],
                "instruction_attributes": ins_attrs,
                "instruction_options": [v for _, v in said],
                "assignment_id": f"GEN{asin}{n}",
                "worker_id": f"W{rng.randint(1, 40):03d}",
            }
        )
    n_reviews = rng.choice((0, 0, 1, 2, 3))
    reviews = [
        {
            "title": rng.choice(_REVIEW_TITLES),
            "stars": str(s),
            "review": _REVIEW_BODIES[5 - s],
        }
        for s in (rng.randint(1, 5) for _ in range(n_reviews))
    ]
    review = {
        "asin": asin,
        "average_rating": round(sum(int(r["stars"]) for r in reviews) / n_reviews, 1)
        if reviews
        else "N.A.",
        "reviews": reviews,
    }
    return raw, synthetic, human, review


def generate_catalog(
    n_products: int = 1000, seed: int = 0, *, progress: bool = False
) -> Iterator[tuple[dict, dict, list, dict]]:
    """Yield ``(raw product, items_ins_v2 entry, human instructions, reviews entry)``.

    Kinds are dealt round-robin in a seeded order, so every kind has about
    ``n_products / 20`` products.
    """
    if n_products < 1:
        raise ValueError(f"n_products must be >= 1, got {n_products}")
    rng = random.Random(seed)
    taken: set[str] = set()
    order = list(KINDS)
    it = range(n_products)
    if progress:
        it = tqdm(it, desc="webshop: generating products", unit="product")
    for i in it:
        if i % len(order) == 0:
            rng.shuffle(order)
        yield _product(order[i % len(order)], rng, taken)


def write_catalog(out_dir: str | Path, n_products: int = 1000, seed: int = 0) -> Path:
    """Write the generated catalog's files into ``out_dir`` atomically; returns ``out_dir``.

    The files are written to a temporary sibling folder and renamed into place, so a
    concurrent reader never sees half a catalog.
    """
    out = Path(out_dir)
    if (out / "items_shuffle.json").exists():
        return out
    tmp = out.parent / f".{out.name}.tmp{os.getpid()}"
    tmp.mkdir(parents=True, exist_ok=True)
    products, ins_v2, human, reviews = [], {}, {}, []
    progress = n_products >= 20_000
    for raw, syn, hum, rev in generate_catalog(n_products, seed, progress=progress):
        products.append(raw)
        ins_v2[raw["asin"]] = syn
        human[raw["asin"]] = hum
        reviews.append(rev)
    files = {
        "items_shuffle.json": products,
        "items_ins_v2.json": ins_v2,
        "items_human_ins.json": human,
        "reviews.json": reviews,
    }
    for name, obj in files.items():
        with open(tmp / name, "w", encoding="utf-8") as f:
            json.dump(obj, f, separators=(",", ":"))
    (tmp / "GENERATED.txt").write_text(
        f"branchgym WebShop catalog generator v{GENERATOR_VERSION}: {n_products} products, "
        f"seed {seed}. Synthetic data in the upstream WebShop schemas.\n"
    )
    try:
        tmp.rename(out)
    except OSError:  # another process won the race; use its copy
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return out
