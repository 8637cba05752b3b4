"""Extraction of MIMIC-IV into the parquet event store, the embedded generator, event keys, deletion."""
