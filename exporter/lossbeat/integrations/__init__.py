"""Training-framework integrations; each module imports its framework, this package none.

* :mod:`lossbeat.integrations.hf`: ``LossbeatCallback`` for ``transformers.Trainer`` (extra ``hf``)
* :mod:`lossbeat.integrations.lightning`: ``LossbeatCallback`` for ``lightning.Trainer`` (extra ``lightning``)
"""

__all__: list[str] = []
