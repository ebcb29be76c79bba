"""Store URLs: :func:`open_store` turns one into a store and probes it; :func:`mask_url` hides its secrets.

:func:`open_store` probes the store once (:meth:`Store.check`), so that a wrong endpoint, bucket
or credential fails in seconds with :class:`~hsx.errors.StoreError` rather than after a model has
loaded.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

from hsx.errors import BadConfig

if TYPE_CHECKING:
    from hsx.store.protocol import Store
    from settings import Settings

ACCEPTED_FORMS = "a local path, file:///ABS/PATH, s3://BUCKET or s3://BUCKET/PREFIX"

_SECRET_QUERY_KEYS = {"password", "pass", "pwd", "secret", "token", "access_key", "secret_key", "key"}


def mask_url(url: str) -> str:
    """``url`` with any ``user:password@`` password (or bare ``token@``) and secret query values
    replaced by ``***``, for printing. Non-URLs come back unchanged."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return url
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, _, hostport = netloc.rpartition("@")
        user, sep, _password = userinfo.partition(":")
        netloc = f"{user}:***@{hostport}" if sep else f"***@{hostport}"
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        if any(k.lower() in _SECRET_QUERY_KEYS for k, _ in pairs):
            query = urlencode([(k, "***" if k.lower() in _SECRET_QUERY_KEYS else v) for k, v in pairs], safe="*")
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_ONE_SLASH = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:/(?!/)")


def open_store(url: str, settings: "Settings | None" = None, *, create: bool = True) -> Store:
    """Open the store at ``url`` and probe it once (:meth:`Store.check`).

    ``url``: a local path (relative paths are made absolute; the directory is created unless
    ``create=False``, which the read-only commands and the workers use: a missing directory is
    then refused and nothing is made),
    ``file:///abs/path``, ``s3://bucket`` or ``s3://bucket/prefix``. S3 endpoint, region and
    credentials come from ``settings`` (``HSX_S3_*``) when set, else from boto3's default chain
    (``AWS_*`` variables, ``AWS_ENDPOINT_URL``, profiles).

    Raises :class:`~hsx.errors.BadConfig` for a URL of another form, and
    :class:`~hsx.errors.StoreError` (within ~10 s) when the endpoint is unreachable, the bucket
    is missing, the credentials are refused, or the directory cannot be created (or, with
    ``create=False``, does not exist).
    """
    if not isinstance(url, str) or not url.strip():
        raise BadConfig(f"store URL {url!r} is empty: use {ACCEPTED_FORMS}")
    url = url.strip()
    m = _SCHEME.match(url)
    scheme = m.group(1).lower() if m else ""
    from hsx.store.local import LocalStore
    from hsx.store.s3 import S3Store  # here, not above: s3.py imports mask_url from this module

    if scheme == "s3":
        store: Store = S3Store.from_url(url, settings)
    elif scheme == "file":
        parts = urlsplit(url)
        if parts.netloc not in ("", "localhost") or parts.query or parts.fragment:
            raise BadConfig(f"store URL {mask_url(url)!r} is not a local file URL: use file:///ABS/PATH")
        store = LocalStore(Path(unquote(parts.path)))
    elif scheme:
        raise BadConfig(f"store URL {mask_url(url)!r} has unsupported scheme {scheme!r}: use {ACCEPTED_FORMS}")
    elif _ONE_SLASH.match(url):
        # 's3:/bucket' is a typo of 's3://bucket', not a directory named 's3:' to create
        raise BadConfig(f"store URL {mask_url(url)!r} is a scheme with one slash: use {ACCEPTED_FORMS} "
                        f"(for a local directory whose name ends in ':', write ./{mask_url(url)})")
    else:
        store = LocalStore(Path(url).expanduser())
    store.check(create=create)
    return store
