"""The one exception type users see.

Every check on user input (files, YAML, flags, batches that cannot fit) raises `DhpError` with a message
that names the offending value and says how to fix it. The CLI prints that message as one line and exits
non-zero; library callers can catch it as a `ValueError`.
"""


class DhpError(ValueError):
    """A user-facing error: bad input or a request that cannot be satisfied."""
