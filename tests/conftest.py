import os

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

from hypothesis import settings

# "ci" keeps the suite within CI's budget; HYPOTHESIS_PROFILE=stress runs the solver properties at length.
settings.register_profile("ci", max_examples=200)
settings.register_profile("stress", max_examples=3000)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
