"""The cohorts package's named errors (a module of its own, so that every config reader can raise them)."""


class CohortConfigError(ValueError):
    """The cohort configuration is missing a field or has an invalid one."""
