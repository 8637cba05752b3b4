"""Which failures are the user's to act on (exit 2, one line) and which are ours (exit 1): the same answer for a
command's own failure and for one a serving process met on its behalf (:mod:`flows.deletion_desk`). The error
types are imported when one is met: a command's first imports are its own, so its server starts sooner."""
from __future__ import annotations


def failure_status(e: Exception) -> int:
    """0: nothing to do (the subject was deleted before); 2: bad input or a refusal; 1: a defect of ours."""
    from cohorts.definitions import CohortConfigError
    from deletion import AlreadyDeleted, DeletionFailed
    from flows.api_server import ServerStartError
    from flows.deletion_desk import DeskStopped
    from pipeline.extract import ExtractionError
    from pipeline.locking import WorkspaceLocked
    if isinstance(e, AlreadyDeleted):
        return 0
    if isinstance(e, (ExtractionError, CohortConfigError, WorkspaceLocked, DeletionFailed, ServerStartError,
                      DeskStopped, ValueError, KeyError, OSError)):
        return 2
    return 1
