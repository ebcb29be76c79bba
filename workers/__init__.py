"""GPU side: the Celery app and task, model loading, capture, shard writing and storing.

``celery -A workers worker -Q gpu`` finds :data:`app` here.
"""

from workers.app import app

__all__ = ["app"]
