"""The error type users see from the pipeline: one line that names the problem."""


class FluxError(ValueError):
    """Bad input or an impossible request (size, steps, memory), said in our words."""
