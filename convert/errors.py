"""The one exception type of convert/: every refusal names the file (and key) at fault."""


class ConvertError(ValueError):
    """A checkpoint that cannot be read or written as asked; the message names the file and key."""
