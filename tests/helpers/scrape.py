"""Scraping an exporter as Prometheus does: one GET of /metrics, parsed with prometheus_client's own
parser. Every test that reads a live endpoint goes through here."""

from __future__ import annotations

import http.client
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

Series = dict[str, list[tuple[dict[str, str], float]]]


def metrics_text(port: int, *, source: str | None = None, timeout: float = 10.0) -> str:
    """The body of ``http://127.0.0.1:PORT/metrics``; from the loopback address ``source`` when
    given, with Prometheus' headers (one replica of an HA pair is told apart by its address)."""
    if source is None:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout) as response:
            return response.read().decode()
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout, source_address=(source, 0))
    try:
        connection.request(
            "GET",
            "/metrics",
            headers={"User-Agent": "Prometheus/2.45.3", "X-Prometheus-Scrape-Timeout-Seconds": str(int(timeout))},
        )
        return connection.getresponse().read().decode()
    finally:
        connection.close()


def series(text: str, drop: tuple[str, ...] = ()) -> Series:
    """{sample name: [(labels, value), ...]}, the labels in ``drop`` left out."""
    out: Series = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = {k: v for k, v in s.labels.items() if k not in drop}
            out.setdefault(s.name, []).append((labels, s.value))
    return out


def flat(text: str, drop: tuple[str, ...] = ("rank", "run_id")) -> dict[str, float]:
    """{'name{k="v",...}': value} (sorted labels, those in ``drop`` left out; a bare name without labels)."""
    out = {}
    for name, found in series(text, drop).items():
        for labels, value in found:
            inner = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
            out[f"{name}{{{inner}}}" if inner else name] = value
    return out


def scrape(port: int, drop: tuple[str, ...] = ()) -> Series:
    """One scrape of ``port``, as :func:`series`."""
    return series(metrics_text(port), drop)
