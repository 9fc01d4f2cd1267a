"""A run requeued onto another node keeps its run identity (Slurm keeps the job id, torchrun its
run id); its old instance's identity does not survive. End to end: a real exporter of rank 0
of run 4242 is killed (a preemption: no completion marker), TrainingExporterDown fires for its
instance; the same rank of the same run comes back on another port and hangs. The old
instance's TrainingExporterDown resolves once the rank reports again, so it inhibits nothing,
and the requeued run's TrainingStalled reaches the paging route of the shipped
alertmanager.yml (inhibitedBy empty).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from lossbeat.stack.local import write_target_groups

from .e2e_harness import alertmanager_alerts, free_port, terminate, wait_for_page, wait_until

ROOT = Path(__file__).resolve().parents[2]
JOB = "e2e-requeue"
RUN_ID = "4242"
# Rank 0 of run 4242: observes a step every 0.1 s; "hang" stops observing after 20 steps and
# keeps serving (a hung collective), "run" goes on until killed.
EXPORTER = """
import sys, time
from lossbeat import start_exporter
port, mode = int(sys.argv[1]), sys.argv[2]
m = start_exporter(port, addr="127.0.0.1", port_per_local_rank=False, run_id="4242", linger_seconds=0)
step = 0
while mode == "run" or step < 20:
    step += 1
    m.observe(step, loss=2.0 - step * 1e-4)
    time.sleep(0.1)
while True:
    time.sleep(1)
"""


def _exporter(port: int, mode: str, log: Path) -> subprocess.Popen:
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "LOSSBEAT_"))},
        "PYTHONPATH": str(ROOT / "exporter"),
        "RANK": "0",
        "WORLD_SIZE": "1",
    }
    with open(log, "wb") as out:
        return subprocess.Popen(
            [sys.executable, "-c", EXPORTER, str(port), mode], env=env, stdout=out, stderr=subprocess.STDOUT
        )


def test_a_requeued_runs_hang_pages_and_the_old_instance_inhibits_nothing(stack, prometheus, receiver, tmp_path):
    old_port, new_port = free_port(), free_port()
    old_target, new_target = f"127.0.0.1:{old_port}", f"127.0.0.1:{new_port}"
    procs = [_exporter(old_port, "run", tmp_path / "old.log")]
    try:
        write_target_groups(stack.targets_file, [{"targets": [old_target], "labels": {"job": JOB}}])
        wait_until(
            lambda: prometheus.query(f'training_steps_total{{job="{JOB}",run_id="{RUN_ID}"}} > 5'),
            120,
            "the first attempt scraped",
        )
        # Preempted: killed without the completion marker; Slurm requeues it onto another node.
        procs[0].kill()
        procs[0].wait(10)
        wait_until(
            lambda: prometheus.firing("TrainingExporterDown", job=JOB, instance=old_target),
            90,
            "TrainingExporterDown for the preempted instance",
        )
        procs.append(_exporter(new_port, "hang", tmp_path / "new.log"))
        groups = [{"targets": [old_target, new_target], "labels": {"job": JOB}}]
        write_target_groups(stack.targets_file, groups)
        # The requeued rank reports: the old instance's down resolves.
        wait_until(
            lambda: prometheus.query(f'training_steps_total{{job="{JOB}",instance="{new_target}"}}'),
            120,
            "the requeued rank scraped",
        )

        # The requeued run hangs: its stall reaches Alertmanager, inhibited by nothing (the old
        # instance's TrainingExporterDown, firing for hours before, would hold it across the run).
        def stalled():
            found = alertmanager_alerts(stack.alertmanager_url, "TrainingStalled")
            return [a for a in found if a["labels"]["job"] == JOB]

        held = wait_until(stalled, 120, "TrainingStalled of the requeued run in Alertmanager")
        assert all(a["labels"]["instance"] == new_target for a in held), held
        assert all(a["status"]["inhibitedBy"] == [] and a["status"]["state"] == "active" for a in held), held
        assert not prometheus.firing("TrainingExporterDown", job=JOB, instance=old_target)
        wait_for_page(receiver, "TrainingStalled", JOB, timeout=60)
    finally:
        write_target_groups(stack.targets_file, [])
        for proc in procs:
            terminate(proc)
