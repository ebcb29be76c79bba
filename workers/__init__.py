"""GPU side: the Celery app and task, model loading, capture, shard writing and storing.

``celery -A workers worker -Q gpu`` finds :data:`app` here. The app is created on first access,
so that importing ``workers.capture`` (tests, benchmarks) needs no broker URL.
"""


def __getattr__(name: str):
    if name == "app":
        from workers.app import app

        return app
    raise AttributeError(name)
