"""``python -m producer flower``: Flower (the Celery web monitor) on the run's broker.

Flower shows every task (name ``hsx.extract_batch``, arguments ``run=<id> batch=<b> samples=<n>
tokens=<n>``, state, worker, runtime, result) and every worker, from the events the workers send
(``python -m workers`` starts them with ``-E``; the producer sends ``task-sent`` events). It runs in
this process with a Celery app built from the settings, so the broker password never appears on a
command line.

Exposure rules (docs/FACTS.md §6):

- It binds to 127.0.0.1 unless told otherwise; any other address needs basic auth
  (``HSX_FLOWER_BASIC_AUTH=user:password``), or it refuses to start.
- Flower 2.2's HTTP API (``/api/workers``, ``/api/tasks``, ...) answers with basic auth, or
  without any auth only when ``FLOWER_UNAUTHENTICATED_API`` is set; ``--unauthenticated-api`` sets
  it, on loopback only (Flower then also sends ``Access-Control-Allow-Origin: *``, so any web page
  open in a browser on this machine can read and call the API).
- ``/metrics`` and ``/healthcheck`` stay open even with basic auth: bind to loopback or a
  private network, never to a public interface.
"""

from __future__ import annotations

import ipaddress
import os

from hsx.errors import BadConfig
from hsx.queue import make_celery
from settings import Settings

LOOPBACK = ("127.0.0.1", "::1", "localhost")


def is_loopback(address: str) -> bool:
    """True for 127.0.0.0/8, ::1 and ``localhost``; False for ``0.0.0.0`` and every other address."""
    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False  # a host name: may resolve to anything


def check_basic_auth(value: str) -> None:
    """Refuse a malformed ``USER:PASSWORD[,USER:PASSWORD...]`` without echoing it (it holds passwords)."""
    for pair in value.split(","):
        user, sep, password = pair.partition(":")
        if not sep or not user or not password:
            raise BadConfig("HSX_FLOWER_BASIC_AUTH must be USER:PASSWORD (comma-separated for several users), "
                            "both parts non-empty; its value is not shown because it holds passwords")


def resolve_broker_url(settings: Settings, given: str | None = None) -> str | None:
    """The broker to monitor: ``given``, else ``HSX_BROKER_URL``, else the embedded broker of a
    ``producer run`` going on on this machine (see :func:`hsx.broker.running_embedded_broker`)."""
    from hsx.broker import running_embedded_broker

    return given or settings.broker_url or running_embedded_broker(settings.broker_state_dir)


def flower_argv(address: str, port: int, basic_auth: str | None, *, url_prefix: str | None = None) -> list[str]:
    """The ``celery flower`` arguments for these options (Flower's own tornado options)."""
    argv = ["flower", f"--address={address}", f"--port={port}"]
    if basic_auth:
        argv.append(f"--basic_auth={basic_auth}")
    if url_prefix:
        argv.append(f"--url_prefix={url_prefix}")
    return argv


def run_flower(settings: Settings, *, address: str = "127.0.0.1", port: int = 5555, broker_url: str | None = None,
               unauthenticated_api: bool = False, url_prefix: str | None = None) -> int:
    """Serve Flower until interrupted; returns Celery's exit code.

    Raises:
        BadConfig: no broker to monitor, a non-loopback address without basic auth, a malformed
            ``HSX_FLOWER_BASIC_AUTH``, or ``unauthenticated_api`` on a non-loopback address.
    """
    url = resolve_broker_url(settings, broker_url)
    if not url:
        raise BadConfig(
            "no broker to monitor: set HSX_BROKER_URL (redis://:PASSWORD@HOST:6379/0), or start "
            "'python -m producer run' on this machine first (its embedded broker is found while it runs)"
        )
    auth = settings.flower_basic_auth
    if auth:
        check_basic_auth(auth)
    if not is_loopback(address):
        if not auth:
            raise BadConfig(
                f"Flower bound to {address} would let anyone who reaches it see and revoke tasks and shut workers down: "
                "set HSX_FLOWER_BASIC_AUTH=user:password, or keep the default --address 127.0.0.1"
            )
        if unauthenticated_api:
            raise BadConfig(f"--unauthenticated-api is allowed on loopback only, not on {address}")
    if unauthenticated_api and not auth:
        # Flower reads this from the environment at each API request; it is Flower's switch, not ours.
        os.environ["FLOWER_UNAUTHENTICATED_API"] = "true"
    from hsx.broker import check_broker

    check_broker(url)
    app = make_celery(settings, url, name="hsx-flower")
    return app.start(flower_argv(address, port, auth, url_prefix=url_prefix)) or 0
