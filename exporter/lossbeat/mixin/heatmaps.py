"""The options every Grafana heatmap panel of the dashboards shares; each panel names only its colours."""

from __future__ import annotations

from typing import Any

__all__ = ["heatmap_options"]


def heatmap_options(
    scheme: str, *, reverse_colours: bool = False, rows_reversed: bool = True, hide_below: float = 1e-9, **scale: float
) -> dict[str, Any]:
    """A heatmap of precomputed buckets in ``scheme``; ``scale`` (``min``, ``max``) clips its colours,
    cells at or below ``hide_below`` are left blank, and ``rows_reversed`` puts the first row on top."""
    return {
        "calculate": False,
        "cellGap": 1,
        "color": {
            "exponent": 0.5,
            "fill": "dark-orange",
            "mode": "scheme",
            "reverse": reverse_colours,
            "scale": "linear",
            "scheme": scheme,
            "steps": 64,
            **scale,
        },
        "exemplars": {"color": "rgba(255,0,255,0.7)"},
        "filterValues": {"le": hide_below},
        "legend": {"show": True},
        "rowsFrame": {"layout": "auto"},
        "showValue": "never",
        "tooltip": {"mode": "single", "showColorScale": True, "yHistogram": False},
        "yAxis": {"axisPlacement": "left", "reverse": rows_reversed},
    }
