"""Training-framework integrations; each module imports its framework, this package none.

* :mod:`lossbeat.integrations.hf`: ``LossbeatCallback`` for ``transformers.Trainer`` (extra ``hf``)
* :mod:`lossbeat.integrations.lightning`: ``LossbeatCallback`` for ``lightning.Trainer`` (extra ``lightning``)
* :mod:`lossbeat.integrations.olmo_core`: ``LossbeatCallback`` for the OLMo-core ``Trainer`` (extra ``olmo``)
* :mod:`lossbeat.integrations.torchtitan`: ``LossbeatLogger`` / ``LossbeatMetricsProcessor`` for torchtitan
  (extra ``torchtitan``; tested on CPU through its logger interface only, not yet released)
"""

__all__: list[str] = []
