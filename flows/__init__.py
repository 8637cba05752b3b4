"""Prefect flows and the forgetful command line."""
