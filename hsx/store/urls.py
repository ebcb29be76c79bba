"""Store URLs: :func:`open_store` turns one (parsed by :mod:`hsx.storeurl`) into a store and probes it.

:func:`open_store` probes the store once (the backend's ``check``), so that a wrong endpoint, bucket
or credential fails in seconds with :class:`~hsx.errors.StoreError` rather than after a model has
loaded.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from hsx.store.local import LocalStore
from hsx.store.s3 import S3Store
from hsx.storeurl import ACCEPTED_FORMS, StoreURL, mask_url, parse_store_url

if TYPE_CHECKING:
    from hsx.store.protocol import Store
    from settings import Settings


def open_store(url: "str | StoreURL", settings: "Settings | None" = None, *, create: bool = True) -> Store:
    """Open the store at ``url`` and probe it once (the backend's ``check``).

    ``url``: a local path (relative paths are made absolute; the directory is created unless
    ``create=False``, which the read-only commands and the workers use: a missing directory is
    then refused and nothing is made),
    ``file:///abs/path``, ``s3://bucket`` or ``s3://bucket/prefix``. S3 endpoint, region and
    credentials come from ``settings`` (``HSX_S3_*``) when set, else from boto3's default chain
    (``AWS_*`` variables, ``AWS_ENDPOINT_URL``, profiles).

    The URL's rules are :func:`hsx.storeurl.parse_store_url`'s (a parsed :class:`StoreURL` is taken as is).

    Raises :class:`~hsx.errors.BadConfig` for a URL of another form, and
    :class:`~hsx.errors.StoreError` (within ~10 s) when the endpoint is unreachable, the bucket
    is missing, the credentials are refused, or the directory cannot be created (or, with
    ``create=False``, does not exist).
    """
    location = url if isinstance(url, StoreURL) else parse_store_url(url)
    store: Store = S3Store.from_url(location, settings) if location.is_s3 else LocalStore(Path(location.path))
    store.check(create=create)
    return store


__all__ = ["open_store", "mask_url", "ACCEPTED_FORMS"]
