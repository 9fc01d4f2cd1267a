"""A real Prometheus scrapes a real training loop's /metrics over mutual TLS with basic auth
(its ``tls_config`` and ``basic_auth``), and scrapers missing the certificate or the password
get nothing: their targets are down with the server's refusal as the error."""

from __future__ import annotations

import subprocess
import threading

import pytest
import torch
import yaml
from conftest import require_binary, require_module
from helpers.tls_certs import make_certs

from lossbeat import Monitor, MonitorConfig

from .e2e_harness import Prometheus, free_port, terminate, wait_until


def _training_loop(monitor: Monitor, stop: threading.Event) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = torch.randn(64, 8), torch.randn(64, 1)
    step = 0
    while not stop.is_set():
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        monitor.observe(step, loss=loss, optimizer=optimizer, model=model)
        optimizer.step()
        step += 1
        stop.wait(0.02)


@pytest.fixture
def secure_monitor(tmp_path):
    bcrypt = require_module("bcrypt")
    certs = make_certs(tmp_path)
    web = tmp_path / "web.yml"
    web.write_text(
        yaml.safe_dump(
            {
                "tls_server_config": {
                    "cert_file": "server.crt",
                    "key_file": "server.key",
                    "client_ca_file": "ca.crt",
                    "client_auth_type": "RequireAndVerifyClientCert",
                },
                "basic_auth_users": {"prometheus": bcrypt.hashpw(b"s3cret", bcrypt.gensalt(rounds=10)).decode()},
            }
        )
    )
    monitor = Monitor(MonitorConfig(port=0, addr="127.0.0.1", web_config=str(web), run_name="tls-e2e"))
    stop = threading.Event()
    trainer = threading.Thread(target=_training_loop, args=(monitor, stop), daemon=True)
    trainer.start()
    yield monitor, certs
    stop.set()
    trainer.join(10)
    monitor.close()


def test_prometheus_scrapes_over_mutual_tls_with_basic_auth(secure_monitor, tmp_path):
    prometheus_bin = require_binary("prometheus")
    monitor, certs = secure_monitor
    target = {"targets": [f"127.0.0.1:{monitor.port}"]}
    client_tls = {"ca_file": str(certs.ca), "cert_file": str(certs.client_cert), "key_file": str(certs.client_key)}
    password = {"username": "prometheus", "password": "s3cret"}
    jobs = {
        "secure": {"scheme": "https", "tls_config": client_tls, "basic_auth": password},
        "no-password": {"scheme": "https", "tls_config": client_tls},
        "wrong-password": {
            "scheme": "https",
            "tls_config": client_tls,
            "basic_auth": {"username": "prometheus", "password": "guess"},
        },
        "no-client-cert": {"scheme": "https", "tls_config": {"ca_file": str(certs.ca)}, "basic_auth": password},
        "rogue-client-cert": {
            "scheme": "https",
            "basic_auth": password,
            "tls_config": {
                "ca_file": str(certs.ca),
                "cert_file": str(certs.rogue_cert),
                "key_file": str(certs.rogue_key),
            },
        },
        "plain-http": {"scheme": "http", "basic_auth": password},
    }
    config = {
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [{"job_name": job, "static_configs": [target], **settings} for job, settings in jobs.items()],
    }
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    log = open(tmp_path / "prometheus.log", "wb")
    proc = subprocess.Popen(
        [
            prometheus_bin,
            f"--config.file={tmp_path / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
    )
    try:
        api = Prometheus(f"http://127.0.0.1:{port}")

        def targets_scraped():
            try:
                targets = api._get("/api/v1/targets")["activeTargets"]
            except OSError:
                return None
            done = {t["labels"]["job"]: t for t in targets if t["health"] != "unknown"}
            return done if len(done) == len(jobs) else None

        def answered():
            # Every target's last scrape got its answer: the secure one up, the two without the
            # right password refused with 401. On a busy machine a scrape can time out (1 s); the
            # next one, a second later, answers, so a timeout is waited past, never a verdict.
            scraped = targets_scraped()
            if not scraped or scraped["secure"]["health"] != "up":
                return None
            if any("401" not in scraped[job]["lastError"] for job in ("no-password", "wrong-password")):
                return None
            return scraped

        targets = wait_until(answered, 180, "every target scraped, the secure one up, the others refused")
        for job in jobs:
            if job != "secure":
                assert targets[job]["health"] == "down", (job, targets[job])
        assert "401" in targets["no-password"]["lastError"]
        assert "401" in targets["wrong-password"]["lastError"]
        for job in ("no-client-cert", "rogue-client-cert", "plain-http"):
            assert targets[job]["lastError"], job  # a refused handshake: no HTTP answer at all

        def series():
            result = api.query('training_loss{job="secure"}')
            return result if result else None

        loss = wait_until(series, 30, "training_loss scraped over TLS")
        assert float(loss[0]["value"][1]) > 0
        up = {r["metric"]["job"]: float(r["value"][1]) for r in api.query("up")}
        assert up == {"secure": 1.0, **{job: 0.0 for job in jobs if job != "secure"}}
        run = api.query('training_run_info{job="secure"}')
        assert run and run[0]["metric"]["run"] == "tls-e2e"
        # Nothing of the run reached the refused scrapers.
        assert api.query('training_loss{job!="secure"}') == []
    finally:
        terminate(proc)
        log.close()
