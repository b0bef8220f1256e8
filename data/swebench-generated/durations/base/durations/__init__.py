from durations.core import parse_duration
