"""Where runs live: a local directory or an S3 bucket, behind one Protocol of what the callers use.

| module | what |
|---|---|
| :mod:`hsx.store.protocol` | the :class:`Store` Protocol, its contract (atomicity, errors), :class:`MissingKey`, key rules |
| :mod:`hsx.store.local` | :class:`LocalStore`, a directory |
| :mod:`hsx.store.s3` | :class:`S3Store`, a bucket: the only module that talks to boto3 / botocore |
| :mod:`hsx.store.urls` | :func:`open_store` (URL -> probed store); the URL itself is :mod:`hsx.storeurl`'s |
| :mod:`hsx.store.helpers` | :func:`exists`, :func:`write_file`, :func:`verify`, :func:`download`: built from the members |
| :mod:`hsx.store.retry` | :func:`retry_transient`: the callers' retries of a transient StoreError |
| :mod:`hsx.store.hashing` | :func:`sha256_file`, :class:`Sha256Beside` |

Nothing outside this package touches a backend's client: every store call goes through the
Protocol, whose errors say whether a retry may help (``protocol.py``).
"""

from hsx.store.hashing import CHUNK_BYTES, Sha256Beside, sha256_file
from hsx.store.helpers import download, exists, verify, write_file
from hsx.store.local import LocalStore
from hsx.store.protocol import TMP_PREFIX, MissingKey, Store, check_key, check_prefix
from hsx.store.retry import backoff_s, retry_transient
from hsx.store.s3 import S3Store
from hsx.store.urls import ACCEPTED_FORMS, mask_url, open_store
from hsx.storeurl import StoreURL, parse_store_url

__all__ = [
    "ACCEPTED_FORMS", "CHUNK_BYTES", "TMP_PREFIX", "LocalStore", "MissingKey", "S3Store", "Sha256Beside", "Store", "StoreURL",
    "backoff_s", "check_key", "check_prefix", "download", "exists", "mask_url", "open_store", "parse_store_url", "retry_transient",
    "sha256_file", "verify", "write_file",
]
