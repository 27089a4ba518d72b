"""The one error type of weight loading: every message names the file or key at fault."""


class WeightsError(ValueError):
    """A checkpoint is missing, unreadable, of an unknown layout, or does not fit the model."""
