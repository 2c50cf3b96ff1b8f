"""Observability: shared metrics, gauges sampler, /metrics, the staff dashboard and the diagnosis.

Apps register what only they know (their gauges, their diagnosis rules, their dashboard sections) in
their AppConfig.ready() through `observability.registry`; this app imports no other app.
"""
