"""The shipped dashboard and alert rules against a REAL Prometheus scraping a REAL `tenax run`.

Every PromQL expression of deploy/grafana/tenax.json and deploy/prometheus/alerts.yml goes
through Prometheus's HTTP API, so the dashboard cannot drift from the metric names: each
dashboard query must return data, each alert expression must be valid and every metric it names
must exist, and Prometheus must evaluate every rule without error. The scrape config used is
deploy/prometheus/prometheus.yml with only the target, intervals and rule path replaced.

Prometheus comes from the Debian package (`apt-get install -y prometheus`: /usr/bin/prometheus
and promtool). Without it these tests FAIL, on purpose: CI installs it.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
DASHBOARD = DEPLOY / "grafana" / "tenax.json"
ALERTS = DEPLOY / "prometheus" / "alerts.yml"
SCRAPE = DEPLOY / "prometheus" / "prometheus.yml"
INSTALL = ("the `prometheus` binary is missing: install the Debian package with "
           "`sudo apt-get update && sudo apt-get install -y prometheus` (it provides "
           "/usr/bin/prometheus and /usr/bin/promtool); CI installs it")
# Grafana's built-in variables, for a 1 s scrape interval.
GRAFANA_VARS = {"__rate_interval": "4s", "__interval": "2s", "__range": "1m"}


def binary(name: str) -> str:
    path = shutil.which(name) or f"/usr/bin/{name}"
    if not os.access(path, os.X_OK):
        pytest.fail(INSTALL)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(what: str, check: Callable[[], Any], timeout_s: float,
             alive: Callable[[], str | None] = lambda: None) -> Any:
    """Poll `check` until it returns something truthy; fail with `what` after the timeout."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        dead = alive()
        if dead:
            pytest.fail(f"waiting for {what}: {dead}")
        try:
            result = check()
        except (requests.RequestException, KeyError, ValueError):
            result = None
        if result:
            return result
        time.sleep(0.25)  # polling interval of a bounded wait, not a fixed delay
    pytest.fail(f"timed out after {timeout_s:.0f} s waiting for {what}")


def stop(proc: subprocess.Popen, first: int = signal.SIGINT, grace_s: float = 30.0) -> None:
    """Stop a process this module started (its own process group), politely, then firmly."""
    if proc.poll() is None:
        proc.send_signal(first)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def tail(path: Path) -> str:
    return path.read_text(errors="replace")[-3000:] if path.exists() else ""


@dataclass
class RunningJob:
    port: int  # where it serves metrics
    proc: subprocess.Popen
    log: Path


@pytest.fixture(scope="module")
def tenax_job(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningJob]:
    """A real `tenax run --metrics-port` on an embedded Ray."""
    tmp = tmp_path_factory.mktemp("tenax-run")
    port, log = free_port(), tmp / "run.log"
    cmd = [sys.executable, "-m", "tenax.orchestrator.cli.main", "run",
           str(ROOT / "examples" / "tiny.yaml"),
           "--set", "train.steps=100000", "--set", f"checkpoint.uri=file://{tmp}/ckpt",
           "--set", "checkpoint.every_steps=100", "--metrics-port", str(port)]
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "PYTHONPATH": str(ROOT)}
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        exited = lambda: (f"tenax run exited with {proc.returncode}:\n{tail(log)}"  # noqa: E731
                          if proc.poll() is not None else None)
        wait_for("tenax run to serve metrics", lambda: "tenax_job_step{" in requests.get(
            f"http://127.0.0.1:{port}/metrics", timeout=2).text, 60, exited)
        yield RunningJob(port, proc, log)
    finally:
        stop(proc, signal.SIGTERM)


def prometheus_config(metrics_port: int) -> dict[str, Any]:
    """deploy/prometheus/prometheus.yml, pointed at the test job, with 1 s intervals."""
    config = yaml.safe_load(SCRAPE.read_text())
    job = next(c for c in config["scrape_configs"] if c["job_name"] == "tenax")
    assert job["honor_labels"] is True, "the tenax `job` label must survive the scrape"
    config["global"].update({"scrape_interval": "1s", "evaluation_interval": "1s"})
    config["rule_files"] = [str(ALERTS)]
    job["static_configs"] = [{"targets": [f"127.0.0.1:{metrics_port}"]}]
    return config


@pytest.fixture(scope="module")
def prometheus(tenax_job: RunningJob, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real Prometheus on 127.0.0.1 scraping the job; yields its base URL."""
    exe = binary("prometheus")
    tmp = tmp_path_factory.mktemp("prometheus")
    config_file, log = tmp / "prometheus.yml", tmp / "prometheus.log"
    config_file.write_text(yaml.safe_dump(prometheus_config(tenax_job.port)))
    promtool = subprocess.run([binary("promtool"), "check", "config", str(config_file)],
                              capture_output=True, text=True, timeout=60)
    assert promtool.returncode == 0, promtool.stdout + promtool.stderr
    port = free_port()
    cmd = [exe, f"--config.file={config_file}", f"--storage.tsdb.path={tmp / 'data'}",
           f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        exited = lambda: (f"prometheus exited with {proc.returncode}:\n{tail(log)}"  # noqa: E731
                          if proc.poll() is not None else None)
        wait_for("prometheus to be ready", lambda: requests.get(f"{url}/-/ready", timeout=2).ok,
                 30, exited)
        yield url
    finally:
        stop(proc, signal.SIGTERM, 10)


def query(url: str, expr: str, at: float | None = None) -> list[dict[str, Any]]:
    """Instant query; fails the test on a PromQL error, returns the result vector."""
    params = {"query": expr, **({"time": f"{at:.3f}"} if at is not None else {})}
    body = requests.get(f"{url}/api/v1/query", params=params, timeout=10).json()
    assert body["status"] == "success", f"{expr!r}: {body.get('errorType')}: {body.get('error')}"
    return body["data"]["result"]


def dashboard_queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, expr) of every target, rows' nested panels included."""
    out, panels = [], list(dashboard["panels"])
    while panels:
        panel = panels.pop(0)
        panels.extend(panel.get("panels", []))
        out += [(panel["title"], t["expr"]) for t in panel.get("targets", []) if t.get("expr")]
    return out


def substitute(expr: str, values: dict[str, str]) -> str:
    def one(match: re.Match) -> str:
        name = match.group(1) or match.group(2)
        assert name in values, f"unknown dashboard variable ${name} in {expr!r}"
        return values[name]
    return re.sub(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)", one, expr)


def alert_rules() -> list[dict[str, Any]]:
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def metric_names(expr: str) -> set[str]:
    return set(re.findall(r"\btenax_[a-z0-9_]+", expr))


@pytest.mark.slow  # a real Prometheus scraping a real `tenax run`
def test_dashboard_and_alert_queries_run_against_real_prometheus(prometheus: str) -> None:
    url = prometheus
    # Enough history for rate()/increase() windows, with the job running and scored.
    wait_for("a few scrapes of a running, scored job", lambda: (
        query(url, 'count_over_time(tenax_job_step[1m]) >= 8')
        and query(url, 'tenax_job_state{state="RUNNING"} == 1')
        and len(query(url, "tenax_rank_straggler_score")) == 2), 75)
    at = time.time()
    jobs = requests.get(f"{url}/api/v1/label/job/values", params={"match[]": "tenax_job_step"},
                        timeout=10).json()["data"]
    assert len(jobs) == 1 and jobs[0].startswith("tiny-llama-"), jobs  # the job variable's values
    values = {**GRAFANA_VARS, "job": jobs[0], "DS_PROMETHEUS": "prometheus"}

    empty = []
    dashboard = json.loads(DASHBOARD.read_text())
    for title, expr in dashboard_queries(dashboard):
        if not query(url, substitute(expr, values), at):
            empty.append(f"{title}: {expr}")
    assert not empty, "dashboard queries without data:\n" + "\n".join(empty)

    for rule in alert_rules():
        query(url, rule["expr"], at)  # valid PromQL (firing or not)
        for name in metric_names(rule["expr"]):
            assert query(url, f'count({{__name__="{name}"}})', at), f"{rule['alert']}: no {name}"

    def evaluated() -> list[dict[str, Any]] | None:
        groups = requests.get(f"{url}/api/v1/rules", timeout=10).json()["data"]["groups"]
        rules = [r for g in groups for r in g["rules"]]
        done = len(rules) == len(alert_rules()) and all(
            r["lastEvaluation"] > "2000" for r in rules)
        return rules if done else None
    for rule in wait_for("every alert rule to be evaluated", evaluated, 20):
        assert rule["health"] == "ok", f"{rule['name']}: {rule.get('lastError')}"


@pytest.mark.slow  # a real `tenax run`
def test_sigterm_stops_tenax_run_like_ctrl_c(tenax_job: RunningJob) -> None:
    """What a batch scheduler sends: the workers stop, the job ends CANCELLED, the embedded
    Ray goes with it (default SIGTERM killed the driver and left them behind). Runs after the
    Prometheus test, which needs the job running."""
    proc = tenax_job.proc
    assert proc.poll() is None, f"tenax run exited early:\n{tail(tenax_job.log)}"
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=60)
    log = tail(tenax_job.log)
    assert code == 1 and "ended CANCELLED" in log and "interrupted (SIGTERM)" in log, log


def test_promtool_accepts_the_alert_rules() -> None:
    result = subprocess.run([binary("promtool"), "check", "rules", str(ALERTS)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    names = {rule["alert"] for rule in alert_rules()}
    assert {"TenaxRankDown", "TenaxHeartbeatStale", "TenaxStraggler", "TenaxNoProgress",
            "TenaxCheckpointFailing"} <= names


def test_dashboard_is_importable_grafana_json() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["title"] and dashboard["schemaVersion"] >= 30
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource"
    assert variables["DS_PROMETHEUS"]["query"] == "prometheus"
    assert variables["job"]["definition"] == "label_values(tenax_job_step, job)"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        assert {"h", "w", "x", "y"} <= set(panel["gridPos"]), panel["title"]
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${DS_PROMETHEUS}", panel["title"]
            assert panel["targets"], panel["title"]
    exprs = " ".join(expr for _, expr in dashboard_queries(dashboard))
    for shown in ("tenax_rank_up", "tenax_rank_heartbeat_age_seconds",
                  "tenax_rank_tokens_per_second", "tenax_rank_straggler_score", "tenax_job_step",
                  "tenax_job_loss", "tenax_job_state",
                  "tenax_job_world_size", "tenax_job_layout_info", "tenax_job_restarts_total",
                  "tenax_job_recovery_seconds_bucket", "tenax_checkpoint_save_blocked_seconds",
                  "tenax_checkpoint_save_seconds", "tenax_job_goodput_ratio"):
        assert shown in exprs, f"the dashboard does not show {shown}"
    assert any(p["type"] == "heatmap" and "heartbeat" in p["targets"][0]["expr"]
               for p in dashboard["panels"] if p["type"] != "row")


def test_deploy_manifests_parse_with_required_fields() -> None:
    from tenax.orchestrator.spec import parse_spec_text, spec_from_dict

    cluster = yaml.safe_load((DEPLOY / "kuberay" / "raycluster.yaml").read_text())
    assert cluster["apiVersion"] == "ray.io/v1" and cluster["kind"] == "RayCluster"
    head = cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert "tenax serve" in " ".join(head["args"]) and "--address auto" in " ".join(head["args"])
    assert {p["containerPort"] for p in head["ports"]} >= {50051, 9400, 6379}
    workers = cluster["spec"]["workerGroupSpecs"]
    gpu = workers[0]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]
    assert int(gpu) >= 1
    docs = list(yaml.safe_load_all((DEPLOY / "kuberay" / "rayjob.yaml").read_text()))
    job = next(d for d in docs if d["kind"] == "RayJob")
    assert job["apiVersion"] == "ray.io/v1" and job["spec"]["entrypoint"].startswith("tenax run ")
    assert job["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    config_map = next(d for d in docs if d["kind"] == "ConfigMap")
    spec = spec_from_dict(parse_spec_text(config_map["data"]["job.yaml"], "rayjob ConfigMap"))
    assert spec.resources.device == "cuda"
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    assert re.search(r"^ARG BASE_IMAGE=", dockerfile, re.M) and "FROM ${BASE_IMAGE}" in dockerfile
    assert 'ENTRYPOINT ["tenax"]' in dockerfile
