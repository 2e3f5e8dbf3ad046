"""The one exception type users see, and where their warnings point."""

import os
import sys

# fxshard's own code: the package and its passes (a sibling package)
_OWN_DIRS = tuple(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), name) + os.sep
                  for name in ("fxshard", "passes"))


class FxShardError(Exception):
    """A problem the user can fix: the message names the cause, the value and the fix."""


def user_stacklevel() -> int:
    """The `warnings.warn` stacklevel, for the function that calls this, that names the first frame
    outside fxshard: the user's call, however deep in fxshard the warning is raised."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(_OWN_DIRS):
        frame, level = frame.f_back, level + 1
    return level
