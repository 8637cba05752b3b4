"""The self-contained HTML report and the deletion certificates."""
