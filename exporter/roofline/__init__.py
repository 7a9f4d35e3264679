"""The roofline and the verdict.

In: the window's recent requests (``aggregation.window``), the model and hardware of
each served model (``deployments``: the ``catalog/``, a Hugging Face ``config.json``
read by ``hf_config``, a measured profile from ``calibrate``), and the engine's own
counters where it has them (``engine_metrics``).

Out: ``estimate`` the achieved bandwidth and FLOP/s per phase against the peaks (bytes
and FLOPs per step from ``model_costs``), ``verdict`` the phase that dominates, the
resource that limits it and the levers that fit, ``bottleneck`` the timer that runs them
per label set; ``calculator`` the offline ``phasewatch roofline`` tables.
"""
