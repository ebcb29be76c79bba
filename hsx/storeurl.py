"""Store URLs, parsed once: :func:`parse_store_url` turns an address into a :class:`StoreURL`, and
every other module reads that (``hsx.store.open_store`` to build the backend, ``hsx.access`` to
compare roots, ``settings`` and the CLI to print an address with :func:`mask_url`).

Accepted forms (:data:`ACCEPTED_FORMS`): a local path (``~`` expanded, relative to the working
directory), ``file:///ABS/PATH``, ``s3://BUCKET`` or ``s3://BUCKET/PREFIX``. One set of rules for
every caller: an S3 URL carries no credentials, query or fragment and no empty, ``.`` or ``..``
prefix segment; a file URL names no host; ``s3:/bucket`` (one slash) is a typo, not a directory.

It imports nothing of ``hsx.store``: ``settings`` uses it, and the store package's backends read
``settings``.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

from hsx.errors import BadConfig

ACCEPTED_FORMS = "a local path, file:///ABS/PATH, s3://BUCKET or s3://BUCKET/PREFIX"

LOCAL, S3 = "local", "s3"

_SECRET_QUERY_KEYS = {"password", "pass", "pwd", "secret", "token", "access_key", "secret_key", "key"}
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_ONE_SLASH = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:/(?!/)")


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


@dataclass(frozen=True)
class StoreURL:
    """Where a store lives: ``kind`` :data:`LOCAL` (``path``, absolute) or :data:`S3` (``bucket``,
    ``prefix`` without leading or trailing ``/``). Compare two with :meth:`resolved` first."""

    kind: str
    path: str = ""
    bucket: str = ""
    prefix: str = ""

    @property
    def is_s3(self) -> bool:
        """Whether objects live in a bucket (no file to memory-map, a request per call)."""
        return self.kind == S3

    @property
    def is_local(self) -> bool:
        """Whether objects are files under :attr:`path`."""
        return self.kind == LOCAL

    @property
    def segments(self) -> tuple[str, ...]:
        """The S3 prefix's segments (``()`` for a bucket's root or a local store)."""
        return tuple(self.prefix.split("/")) if self.prefix else ()

    def resolved(self) -> "StoreURL":
        """The same address with a local path's links followed (``os.path.realpath``): two spellings
        of one directory compare equal, and a link inside a root that points outside it is outside."""
        return replace(self, path=os.path.realpath(self.path)) if self.is_local else self

    def contains(self, other: "StoreURL") -> bool:
        """Whether ``other`` is this address or inside it, by whole path segments (``/data/out2`` is
        not under ``/data/out``). Both should be :meth:`resolved`."""
        if self.kind != other.kind:
            return False
        if self.is_local:
            return other.path == self.path or other.path.startswith(self.path.rstrip(os.sep) + os.sep)
        return other.bucket == self.bucket and other.segments[:len(self.segments)] == self.segments

    def __str__(self) -> str:
        if self.is_local:
            return self.path
        return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"


def parse_store_url(url: str) -> StoreURL:
    """The :class:`StoreURL` of ``url`` (see the module doc for the forms and rules). Touches no
    filesystem: a local path is made absolute, not resolved (:meth:`StoreURL.resolved` does that).

    Raises:
        BadConfig: the URL is empty, of another form or scheme, an S3 URL with credentials, a query,
            a fragment or a bad prefix segment, or a file URL naming a host; the message gives
            the value (secrets masked), the rule and the forms to use.
    """
    if not isinstance(url, str) or not url.strip():
        raise BadConfig(f"store URL {url!r} is empty: use {ACCEPTED_FORMS}")
    url = url.strip()
    m = _SCHEME.match(url)
    scheme = m.group(1).lower() if m else ""
    if scheme == S3:
        return _parse_s3(url)
    if scheme == "file":
        parts = urlsplit(url)
        if parts.netloc not in ("", "localhost") or parts.query or parts.fragment:
            raise BadConfig(f"store URL {mask_url(url)!r} is not a local file URL: use file:///ABS/PATH")
        return StoreURL(LOCAL, path=os.path.abspath(unquote(parts.path)))
    if scheme:
        raise BadConfig(f"store URL {mask_url(url)!r} has unsupported scheme {scheme!r}: use {ACCEPTED_FORMS}")
    if _ONE_SLASH.match(url):
        # 's3:/bucket' is a typo of 's3://bucket', not a directory named 's3:' to create
        raise BadConfig(f"store URL {mask_url(url)!r} is a scheme with one slash: use {ACCEPTED_FORMS} "
                        f"(for a local directory whose name ends in ':', write ./{mask_url(url)})")
    return StoreURL(LOCAL, path=os.path.abspath(os.path.expanduser(url)))


def _parse_s3(url: str) -> StoreURL:
    parts = urlsplit(url)
    if "@" in parts.netloc:
        raise BadConfig(f"store URL {mask_url(url)!r} carries credentials: put them in HSX_S3_ACCESS_KEY_ID / "
                        "HSX_S3_SECRET_ACCESS_KEY and use s3://BUCKET/PREFIX")
    if not parts.netloc or parts.query or parts.fragment:
        raise BadConfig(f"store URL {mask_url(url)!r} is not s3://BUCKET or s3://BUCKET/PREFIX")
    prefix = parts.path.strip("/")
    if prefix and any(s in ("", ".", "..") for s in prefix.split("/")):
        raise BadConfig(f"store URL {url!r}: bad prefix: empty, '.' and '..' segments are not allowed in an S3 "
                        "prefix (keys must stay inside the bucket's prefix); use s3://BUCKET/PREFIX")
    return StoreURL(S3, bucket=parts.netloc, prefix=prefix)


__all__ = ["StoreURL", "parse_store_url", "mask_url", "ACCEPTED_FORMS", "LOCAL", "S3"]
