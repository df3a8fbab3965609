class DyspecError(ValueError):
    """A user-facing error: bad input or an unusable environment. The CLI prints it as one line."""
