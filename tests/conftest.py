import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import settings

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
# The keyed-hash secret lives outside every workspace; the tests' is a fixed, non-secret one.
os.environ.setdefault("FORGETFUL_HASH_KEY", "test-key-not-secret-0123456789abcdef")
if not os.environ.get("FORGETFUL_SIGNING_KEY_FILE"):
    # the deletion log's signing key, outside every test workspace, removed when the session ends
    _keys = Path(tempfile.mkdtemp(prefix="forgetful-test-keys-"))
    atexit.register(shutil.rmtree, _keys, True)
    from pipeline.evidence import write_signing_key
    os.environ["FORGETFUL_SIGNING_KEY_FILE"] = str(write_signing_key(_keys / "signing.pem"))

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


@pytest.fixture(autouse=True)
def _environment_per_test():
    """The CLI, called in-process, sets Prefect's settings in os.environ for its workers (the console log level
    among them); one test's must not reach a later test's subprocesses (CI ran a verbose CLI test after a quiet
    one and its log lacked the lines it counts)."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def pytest_collection_modifyitems(items):
    """A test on a Prefect server (directly or through a workspace built by the flows) is slow: the fast loop,
    ``pytest -m "not slow"``, starts no server."""
    for item in items:
        if "prefect_server" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)
