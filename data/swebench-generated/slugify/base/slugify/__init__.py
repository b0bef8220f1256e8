from slugify.core import slugify
