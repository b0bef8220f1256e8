"""A tiny hand-written WebShop catalog in the upstream file schemas, for golden tests."""

import json
from pathlib import Path

PRODUCTS = [
    {
        "asin": "B000TEST01",
        "name": "Acme Tea Tree Shampoo, Sulfate Free",
        "category": "beauty",
        "query": "Shampoo ",
        "product_category": "Beauty & Personal Care › Hair Care › Shampoos",
        "full_description": "A gentle shampoo with tea tree oil.",
        "small_description": ["Sulfate free formula", "Made with natural ingredients"],
        "pricing": "$12.99",
        "images": ["img/B000TEST01.jpg"],
        "customization_options": {
            "Size": [{"value": "8 fl oz", "image": None}, {"value": "16 fl oz", "image": None}],
            "Scent": [{"value": "Tea Tree"}, {"value": "Lavender/Mint"}],
        },
        "title_nouns": ["acme", "tea", "tree", "shampoo"],
    },
    {
        "asin": "B000TEST02",
        "name": "Bolt Running Shoes",
        "category": "fashion",
        "query": "running shoes",
        "product_category": "Clothing, Shoes & Jewelry › Men › Shoes › Running",
        "full_description": "",
        "small_description": "Lightweight mesh",
        "pricing": "$45.00 - $60.00",
        "images": ["img/B000TEST02.jpg"],
        "customization_options": {
            "color": [{"value": "Black"}, {"value": "Navy Blue"}],
            "size": [{"value": "9"}, {"value": "10"}],
        },
        "title_nouns": ["bolt", "shoes"],
    },
    {
        "asin": "B000TEST03",
        "name": "Acme Daily Shampoo",
        "category": "beauty",
        "query": "shampoo",
        "product_category": "Beauty & Personal Care › Hair Care › Shampoos",
        "full_description": "Everyday shampoo for all hair types.",
        "small_description": ["For all hair types"],
        "pricing": "",
        "images": [],
        "customization_options": None,
    },
] + [
    {
        "asin": f"B000FILL{i:02d}",
        "name": f"Filler Shampoo Number {i}",
        "category": "beauty",
        "query": "shampoo",
        "product_category": "Beauty & Personal Care › Hair Care › Shampoos",
        "full_description": "A shampoo.",
        "small_description": ["Shampoo"],
        "pricing": f"${i}.50",
        "images": [f"img/F{i}.jpg"],
        "customization_options": {},
    }
    for i in range(1, 11)
]

ATTRIBUTES = {
    "B000TEST01": {
        "attributes": ["sulfate free", "tea tree"],
        "instruction": "i want a sulfate free shampoo",
        "instruction_attributes": ["sulfate free"],
    },
    "B000TEST02": {
        "attributes": ["lightweight", "breathable mesh"],
        "instruction": "i want lightweight running shoes",
        "instruction_attributes": ["lightweight"],
    },
}

HUMAN = {
    "B000TEST01": [
        {
            "asin": "B000TEST01",
            "instruction": "i need a sulfate free tea tree shampoo in 16 fl oz.",
            "instruction_attributes": ["sulfate free", "tea tree"],
            "instruction_options": ["16 fl oz"],
        },
        {
            "asin": "B000TEST01",
            "instruction": "an instruction without attributes is skipped",
            "instruction_attributes": [],
            "instruction_options": [],
        },
    ],
    "B000TEST02": [
        {
            "asin": "B000TEST02",
            "instruction": "i want lightweight running shoes in navy blue, size 10",
            "instruction_attributes": ["lightweight"],
            "instruction_options": ["navy blue", "10"],
        }
    ],
}

REVIEWS = [
    {
        "asin": "B000TEST01",
        "average_rating": 4.5,
        "reviews": [
            {"title": "Great", "stars": "5", "review": "Smells nice."},
            {"title": "Okay", "score": 4, "body": "Fine."},
        ],
    }
]


def write_catalog(folder: Path) -> Path:
    """Write the four files into ``folder``; returns it."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, obj in [
        ("items_shuffle_1000.json", PRODUCTS),
        ("items_ins_v2_1000.json", ATTRIBUTES),
        ("items_human_ins.json", HUMAN),
        ("reviews.json", REVIEWS),
    ]:
        (folder / name).write_text(json.dumps(obj), encoding="utf-8")
    return folder
