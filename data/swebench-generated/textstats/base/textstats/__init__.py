from textstats.core import longest_word, word_count, words
