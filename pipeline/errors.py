"""The project's own error types: the only ones a command reports as the user's to act on (exit 2).

- :class:`InputError`: what the user gave is wrong (a source file, an option, a config, a key, a workspace's
  damaged file);
- :class:`Refusal`: the request is refused as things stand (the workspace is held, a check failed);
- :class:`EnvironmentProblem`: the machine or a service it needs (a server that does not answer).

Anything else, a builtin ``KeyError`` or ``ValueError`` from our code included, is a defect of ours (exit 1,
"internal error"); a file-system ``OSError`` (a full disk, a permission) is the environment's. The SV memory,
the lowest layer, keeps its own types (:mod:`memory.errors`); :mod:`flows.failures` names its two that are
input (an infeasible C, a non-finite key). Standard library only: every layer imports it, the CLI's first
steps included.
"""
from __future__ import annotations


class ForgetfulError(Exception):
    """Base of the errors a command reports in one line as the user's to act on."""

    def __str__(self):      # a KeyError subclass would quote its sentence
        return str(self.args[0]) if self.args else ""


class InputError(ForgetfulError, ValueError):
    """Bad input: a file, an option, a config, a key or a workspace file the user can correct or restore."""


class Refusal(ForgetfulError):
    """The request is refused as things stand: nothing was changed."""


class EnvironmentProblem(ForgetfulError, RuntimeError):
    """The machine or a service the command needs is not as it must be."""


class ExtractionError(InputError):
    """The source directory cannot be extracted as it is (missing table or column)."""


class UnknownSubjectError(ExtractionError, KeyError):
    """A subject id with no events in the store."""
