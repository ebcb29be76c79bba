"""What the producer and the workers share: the store, the run config, the shard and marker
formats, layer-id conventions, built-in models, the Celery wiring and the errors.

``producer`` and ``workers`` import from here and never from each other.
"""
