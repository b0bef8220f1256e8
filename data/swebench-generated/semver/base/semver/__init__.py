from semver.core import compare, latest, parse
