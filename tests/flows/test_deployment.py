"""prefect.yaml: the scheduled run as users deploy it (a process work pool, a cron schedule)."""
import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
SPEC = yaml.safe_load((ROOT / "prefect.yaml").read_text())


def test_the_deployment_names_a_real_flow_with_valid_parameters_and_schedule():
    from prefect.client.schemas.schedules import CronSchedule

    from flows import prefect_flows
    from run.params import DEFAULT_CRON, StreamMode
    (dep,) = SPEC["deployments"]
    path, name = dep["entrypoint"].split(":")
    assert (ROOT / path).resolve() == Path(prefect_flows.__file__).resolve()
    flow = getattr(prefect_flows, name)
    assert flow.name == "forgetful-scheduled-run"
    assert set(dep["parameters"]) <= set(inspect.signature(flow.fn).parameters)
    assert dep["parameters"]["tokens"] in {m.value for m in StreamMode}
    for s in dep["schedules"]:
        CronSchedule(cron=s["cron"], timezone=s["timezone"])       # raises on an invalid cron or zone
        assert s["cron"] == DEFAULT_CRON                            # `forgetful serve` schedules the same nights
    assert SPEC["prefect-version"] == __import__("prefect").__version__


@pytest.mark.slow
def test_the_readme_recipe_deploys_and_a_process_worker_runs_the_nightly_flow(prefect_server, tmp_path):
    """prefect work-pool create, prefect deploy --all, a run of the deployment picked up by a process worker."""
    from prefect.client.orchestration import get_client

    from pipeline.generate import GeneratorConfig, generate
    source = generate(tmp_path / "mimic-iv", GeneratorConfig(n_patients=10, seed=5))
    env = dict(os.environ, PREFECT_API_URL=prefect_server, FORGETFUL_REPO=str(ROOT),
               FORGETFUL_WORKSPACE=str(tmp_path / "ws"), FORGETFUL_SOURCE=str(source))
    prefect = [sys.executable, "-m", "prefect"]
    small = '{"budgets": [8, 16], "fractions": [], "cohort_budget": 16, "workers": 2}'
    for cmd in (["work-pool", "create", "forgetful-process", "--type", "process"], ["--no-prompt", "deploy", "--all"],
                ["deployment", "run", "forgetful-scheduled-run/nightly", "--params", small],
                ["worker", "start", "--pool", "forgetful-process", "--run-once"]):
        p = subprocess.run(prefect + cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    with get_client(sync_client=True) as client:
        dep = client.read_deployment_by_name("forgetful-scheduled-run/nightly")
        runs = client.read_flow_runs()
    assert dep.work_pool_name == "forgetful-process"
    assert [s.schedule.cron for s in dep.schedules] == ["0 2 * * *"]
    assert dep.parameters["root"] == str(tmp_path / "ws") and dep.parameters["source"] == str(source)
    assert dep.pull_steps == [{"prefect.deployments.steps.set_working_directory": {"directory": str(ROOT)}}]
    mine = [r for r in runs if r.deployment_id == dep.id]
    assert [r.state.type.value for r in mine] == ["COMPLETED"], [r.state for r in mine]
    assert (tmp_path / "ws" / "report.html").exists()
