import os

import pytest

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
# The keyed-hash secret lives outside every workspace; the tests' is a fixed, non-secret one.
os.environ.setdefault("FORGETFUL_HASH_KEY", "test-key-not-secret")

from hypothesis import settings

# "ci" keeps the suite within CI's budget; HYPOTHESIS_PROFILE=stress runs the solver properties at length.
settings.register_profile("ci", max_examples=200)
settings.register_profile("stress", max_examples=3000)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory):
    """A real ephemeral Prefect server for the session, with PREFECT_HOME in a temp dir; yields its API URL."""
    home = tmp_path_factory.mktemp("prefect-home")
    os.environ["PREFECT_HOME"] = str(home)
    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness
    with prefect_test_harness(server_startup_timeout=180):
        yield PREFECT_API_URL.value()
