"""Checks that need a CUDA device, run by benchmarks/gpu.sh on a lent GPU machine (never part
of the CPU suite, so nothing there skips for a missing GPU):

    python -m pytest -q benchmarks/gpu_checks.py

torchtitan's ``MetricsProcessor`` hard-codes ``device_type = "cuda"``, so lossbeat's processor
subclass is built and driven only here; on CPU its logger backend is tested in
tests/test_pretrain_integrations.py.
"""

from __future__ import annotations

import pytest
import torch
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_torchtitan_processor_on_gpu(tmp_path):
    from torchtitan.distributed import ParallelDims

    from lossbeat.integrations.torchtitan import LossbeatMetricsProcessor

    config = LossbeatMetricsProcessor.Config(log_freq=1, lossbeat_port=0, lossbeat_settings={"linger_seconds": 0})
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, world_size=1)
    processor = config.build(parallel_dims=dims, dump_folder=str(tmp_path))
    processor.num_flops_per_token = 1
    processor.ntokens_since_last_log = 4096
    processor.data_loading_times.append(0.01)
    assert processor.should_log(1)
    processor.log(1, 5.25, 5.5, 0.75, extra_metrics={"n_tokens_seen": 4096, "lr/AdamW": 1e-3})
    monitor = processor.lossbeat.monitor
    monitor.flush()
    samples = {
        s.name: s.value
        for f in text_string_to_metric_families(generate_latest(monitor.registry).decode())
        for s in f.samples
    }
    processor.close()
    assert monitor.closed  # the exporter it started closes with the trainer
    assert samples["training_loss"] == pytest.approx(5.25)
    assert samples["training_grad_norm"] == pytest.approx(0.75)
