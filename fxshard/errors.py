"""The one exception type users see."""


class FxShardError(Exception):
    """A problem the user can fix: the message names the cause, the value and the fix."""
