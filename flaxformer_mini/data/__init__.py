"""Data sources: the synthetic copy task and parallel text."""


class DataError(ValueError):
  """The data cannot be used; the message names the problem and the fix."""
