"""The run: its parameters, its phases over a workspace, its result; the cohort memory it keeps."""
