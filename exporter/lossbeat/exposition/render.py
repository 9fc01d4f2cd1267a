"""The /metrics body: prometheus_client's encoders, with the per-layer gauge written from cached lines.

A model's layers are the bulk of a rank-0 exposition (up to ``max_layers``, 1,000 by default),
and prometheus_client formats every sample alike: it sorts and checks each label name and
escapes each value, about 4 µs a sample. The layer names change rarely (the state swaps the
dict of norms whole, its keys the same step after step), so :class:`LayerFamily` keeps each
layer's line up to its value (``training_layer_grad_norm{layer="...",rank="0",run_id="..."} ``)
and :func:`bake` writes the value after it. Anything that renders a registry the ordinary way
(``generate_latest``) still gets the same samples from a :class:`LayerFamily`.
"""

from __future__ import annotations

import gzip
from typing import Any, Callable, Iterable, Iterator, Mapping

from prometheus_client.exposition import _bake_output, choose_encoder, gzip_accepted
from prometheus_client.metrics_core import Metric
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

__all__ = ["LayerFamily", "LayerLines", "bake"]

# prometheus_client leaves these two untyped: their signatures, as this module calls them.
_float_to_go: Callable[[float], str] = floatToGoString
_bake_ordinary: Callable[
    [Any, str | None, str | None, Mapping[str, Any], bool], tuple[str, list[tuple[str, str]], bytes]
] = _bake_output

_MAX_CACHED = 8192  # layer names whose line prefix is kept (a regrouping brings new ones)


def _escape_label_value(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


class LayerLines:
    """The line prefix of each layer's sample, per (name, fixed labels): built once per layer name."""

    def __init__(self, name: str, label: str, fixed: Mapping[str, str]) -> None:
        self.name, self.label, self.fixed = name, label, dict(fixed)
        self._labels = sorted([label, *fixed])  # prometheus_client writes labels sorted by name
        self._prefixes: dict[str, str] = {}
        self._label_dicts: dict[str, dict[str, str]] = {}

    def prefix(self, value: str) -> str:
        prefix = self._prefixes.get(value)
        if prefix is None:
            if len(self._prefixes) >= _MAX_CACHED:
                self._prefixes.clear()
                self._label_dicts.clear()
            labels = self.labels(value)
            body = ",".join(f'{k}="{_escape_label_value(labels[k])}"' for k in self._labels)
            prefix = self._prefixes[value] = f"{self.name}{{{body}}} "
        return prefix

    def labels(self, value: str) -> dict[str, str]:
        labels = self._label_dicts.get(value)
        if labels is None:
            labels = self._label_dicts[value] = {self.label: value, **self.fixed}
        return labels


class LayerFamily(Metric):
    """A gauge family of one sample per layer, written from :class:`LayerLines` by :func:`bake`.

    ``samples`` (what ``generate_latest`` and tests read) is built when first read."""

    labelled_run_id = True  # its fixed labels hold the run identity (metrics.with_run_id leaves it be)

    def __init__(self, name: str, documentation: str, lines: LayerLines, values: Mapping[str, float]) -> None:
        super().__init__(name, documentation, "gauge")
        self._lines, self._values = lines, values
        self._samples: list[Sample] | None = None

    @property
    def samples(self) -> list[Sample]:
        if self._samples is None:
            labels = self._lines.labels
            self._samples = [Sample(self.name, labels(k), v, None, None) for k, v in self._values.items()]
        return self._samples

    @samples.setter
    def samples(self, value: list[Sample]) -> None:
        self._samples = value if value else None  # Metric.__init__ sets []: the layers are the samples

    def text(self, openmetrics: bool) -> str:
        """The family as the text format (or OpenMetrics, whose HELP escapes quotes too) writes a gauge."""
        prefix = self._lines.prefix
        help_text = self.documentation.replace("\\", r"\\").replace("\n", r"\n")
        if openmetrics:
            help_text = help_text.replace('"', r"\"")
        head = f"# HELP {self.name} {help_text}\n# TYPE {self.name} gauge\n"
        return head + "".join([f"{prefix(k)}{_float_to_go(v)}\n" for k, v in self._values.items()])


class _Families:
    """A registry's families already collected, for an encoder that calls ``collect()``."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self._families = list(families)

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)


def bake(
    registry: Any, accept: str | None, accept_encoding: str | None, params: Mapping[str, Any] | None = None
) -> tuple[str, list[tuple[str, str]], bytes]:
    """(status, headers, body) of a /metrics response, as prometheus_client's ``_bake_output``
    answers it, with each :class:`LayerFamily` written from its cached lines."""
    if params and "name[]" in params:  # a filtered scrape: rare, the ordinary path
        return _bake_ordinary(registry, accept, accept_encoding, params, False)
    encoder, content_type = choose_encoder(accept or "")  # what prometheus_client does with None
    families: list[Metric] = []
    layers: list[LayerFamily] = []
    for family in registry.collect():
        if isinstance(family, LayerFamily):
            layers.append(family)
        else:
            families.append(family)
    output = encoder(_Families(families))
    if layers:
        openmetrics = content_type.startswith("application/openmetrics-text")
        extra = "".join(f.text(openmetrics) for f in layers).encode("utf-8")
        end = b"# EOF\n"
        output = output[: -len(end)] + extra + end if output.endswith(end) else output + extra
    headers = [("Content-Type", content_type)]
    if gzip_accepted(accept_encoding or ""):
        output = gzip.compress(output)
        headers.append(("Content-Encoding", "gzip"))
    return "200 OK", headers, output
