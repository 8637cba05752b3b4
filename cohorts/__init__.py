"""Cohort, deterioration-hour and rare-item definitions, evaluation streams and the budget sweep."""
