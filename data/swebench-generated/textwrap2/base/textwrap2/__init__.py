from textwrap2.core import wrap
