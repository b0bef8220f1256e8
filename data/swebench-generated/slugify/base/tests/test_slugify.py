from slugify import slugify


def test_basic():
    assert slugify("Hello World") == "hello-world"


def test_digits():
    assert slugify("Top 10 Tips") == "top-10-tips"
