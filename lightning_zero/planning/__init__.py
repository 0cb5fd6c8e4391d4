"""Planning a run before it starts: the memory and communication estimator (``estimate``, its arithmetic in
``arguments``, ``counts`` and ``rows``, its result and text in ``estimate_report``) and the activation profile it adds
(``activations``).

Below the doors (``strategies/memory_report.py`` uses it): imports only ``lightning_zero.engine`` and itself.
"""
