from csvline.core import split_row
