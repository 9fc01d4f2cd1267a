"""The shipped sharding configs: valid for promtool, and the shards partition the targets."""

import subprocess

import pytest
import yaml
from conftest import require_binary
from e2e.test_sharded import SHARDING, SHARDS, hashmod_shard

from lossbeat.diagnosis.thresholds import load_thresholds
from lossbeat.mixin.stages import forwarded_names, stage_groups

pytestmark = pytest.mark.servers  # also run against the Prometheus 3 line (make test-prometheus3)


def _load(name: str) -> dict:
    return yaml.safe_load((SHARDING / name).read_text(encoding="utf-8"))


def test_shards_partition_the_targets_with_hashmod():
    regexes = set()
    for shard in range(SHARDS):
        config = _load(f"shard-{shard}.yml")
        assert config["rule_files"][0].endswith("rules-shard.yml")
        assert "external_labels" not in config["global"]  # series must not depend on the shard
        [job] = config["scrape_configs"]
        hashmod, keep = job["relabel_configs"]
        assert hashmod["action"] == "hashmod" and hashmod["modulus"] == SHARDS
        assert hashmod["source_labels"] == ["__address__"]
        assert keep == {"source_labels": [hashmod["target_label"]], "regex": str(shard), "action": "keep"}
        regexes.add(keep["regex"])
        assert job["sample_limit"] > 0
        assert config["remote_write"][0]["url"].endswith("/api/v1/write")
    assert regexes == {str(s) for s in range(SHARDS)}
    # The Python mirror of hashmod used by the e2e test spreads ports over both shards.
    assert {hashmod_shard(f"127.0.0.1:{port}") for port in range(8470, 8478)} == set(range(SHARDS))


def test_the_shards_forward_what_the_global_rules_read_and_no_more():
    """The global reads the shards' partials (labelled with the shard's number) and a few series
    per rank; the raw per-rank series the shards judge stay on the shards."""
    import re

    needed = forwarded_names(load_thresholds())
    assert all(":" in n or n.startswith("training_grad_norm_aligned") for n in needed), sorted(needed)
    per_rank = {n for n in needed if "_shard:" not in n}
    assert len(per_rank) <= 5, sorted(per_rank)
    for shard in range(SHARDS):
        label, keep = _load(f"shard-{shard}.yml")["remote_write"][0]["write_relabel_configs"]
        assert label["target_label"] == "shard" and label["replacement"] == str(shard)
        assert keep["action"] == "keep" and keep["source_labels"] == ["__name__"]
        pattern = re.compile(f"^(?:{keep['regex']})$")  # Prometheus anchors relabel regexes
        assert all(pattern.match(name) for name in needed), sorted(n for n in needed if not pattern.match(n))
        partials = re.compile(f"^(?:{label['regex']})$")
        assert {n for n in needed if partials.match(n)} == needed - per_rank
        for raw in (
            "up",
            "training_loss",
            "training_health_status",
            "training_steps_total",
            "job_run_id_instance_rank_world_size:training_run:present",
        ):
            assert not pattern.match(raw), raw


def test_promtool_accepts_the_sharding_configs(tmp_path):
    promtool = require_binary("promtool")
    for name in ("shard-0.yml", "shard-1.yml", "global.yml"):
        config = _load(name)
        stage = "global" if name == "global.yml" else "shard"
        rules = tmp_path / f"rules-{stage}.yml"
        rules.write_text(yaml.safe_dump({"groups": stage_groups(load_thresholds(), stage)}))
        config["rule_files"] = [str(rules)]
        path = tmp_path / name
        path.write_text(yaml.safe_dump(config))
        result = subprocess.run([promtool, "check", "config", str(path)], capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stdout + result.stderr
