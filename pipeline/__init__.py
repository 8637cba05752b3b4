"""Extraction into the parquet event store, the embedded generator, event keys, the keyed hash and its key,
the deletion log, the workspace lock and transactions."""
