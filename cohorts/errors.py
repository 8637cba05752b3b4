"""The cohorts package's named errors (a module of its own, so that every config reader can raise them)."""
from pipeline.errors import InputError


class CohortConfigError(InputError):
    """The cohort configuration is missing a field or has an invalid one."""


class EmptyRunError(InputError):
    """A run would read or score nothing: a configured channel matches no code of the data, no tokens, no
    evaluation stays. Never a normal-looking report."""
