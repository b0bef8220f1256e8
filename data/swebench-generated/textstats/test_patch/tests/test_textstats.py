from textstats import longest_word, word_count


def test_simple_count():
    assert word_count("the quick brown fox") == 4


def test_longest_word():
    assert longest_word("a bb ccc dd") == "ccc"


def test_repeated_spaces():
    assert word_count("hello  world") == 2


def test_newlines_and_tabs():
    assert word_count("one\ntwo\tthree") == 3


def test_empty_text():
    assert word_count("") == 0
