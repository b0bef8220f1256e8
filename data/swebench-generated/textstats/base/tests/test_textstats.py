from textstats import longest_word, word_count


def test_simple_count():
    assert word_count("the quick brown fox") == 4


def test_longest_word():
    assert longest_word("a bb ccc dd") == "ccc"
