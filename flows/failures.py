"""Which failures are the user's to act on (exit 2, one line) and which are ours (exit 1): the same answer for a
command's own failure and for one a serving process met on its behalf (:mod:`flows.deletion_desk`). Only the
project's own error types (:mod:`pipeline.errors`, and the SV memory's input errors) and the file system's
(a full disk, a permission) are the user's: a builtin ``KeyError`` or ``ValueError`` raised by our code is a
defect, reported as one. The error types are imported when one is met: a command's first imports are its own,
so its server starts sooner."""
from __future__ import annotations

from pipeline.errors import InputError


class CommandLineError(InputError):
    """An option or argument of the command line that cannot be used as given."""


def failure_status(e: BaseException) -> int:
    """0: nothing to do (the subject was deleted before); 2: bad input, a refusal or the environment; 1: a
    defect of ours."""
    from deletion import AlreadyDeleted
    from memory.errors import InfeasibleError, InvalidKeyError
    from pipeline.errors import ForgetfulError
    if isinstance(e, AlreadyDeleted):
        return 0
    if isinstance(e, (ForgetfulError, InfeasibleError, InvalidKeyError, OSError)):
        return 2
    return 1
