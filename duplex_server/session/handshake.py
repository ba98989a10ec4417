"""The one handshake every transport goes through: admission, the hub's books, and a
session opened or resumed for the transport.

* :func:`admit_socket`: a WebSocket upgrade's API key (``Authorization: Bearer``, or the
  key subprotocol) and ``Origin`` (:func:`duplex_server.auth.admit`); Twilio adds its
  request signature on top (:mod:`duplex_server.transports.twilio`); WebRTC's HTTP call request is
  admitted by :class:`duplex_server.auth.HttpAuth` with the same keys and origins.
* :func:`connected` / :func:`disconnected`: the hub's set of live transports (the send
  watchdog and shutdown walk it) and the ``duplex_connections{state="open"}`` gauge.
* :func:`open_session` / :func:`resume_session`: refused with ``engine_unavailable``
  (close 1013, try again; "try again in 2 s" while the engine restarts, docs/scale.md)
  while the server shuts down or the engine is not ready, else
  the session runtime opens a session for the transport (a media transport's session
  settings follow as one ``session.update``) or resumes one onto it.
* :func:`refusal`: a refused handshake's wire error and close code (1008 unless the error
  names another), and :func:`outcome` counts every handshake's result in
  ``duplex_connection_outcomes{outcome}``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from typing import Any

from duplex_contract.errors import EngineError
from duplex_server.auth import AccessDecision, admit
from duplex_server.client_secrets import Use
from duplex_server.protocol import events as ev
from duplex_server.protocol.errors import CloseCode, ProtocolError, SessionFatal, to_wire_error
from duplex_server.session.attach import Attachment
from duplex_server.session.hub import Hub, Transport
from duplex_server.session.live import LiveSession
from duplex_server.session.registry import Prepare


def admit_socket(
    hub: Hub,
    headers: Mapping[str, str],
    subprotocols: Sequence[str],
    secret_use: Use | None = None,
) -> AccessDecision:
    """A WebSocket upgrade: its API key and origin (and the subprotocol to echo);
    ``secret_use``: what a client secret may do on this socket (None: refused)."""
    s = hub.config.server
    return admit(
        headers,
        subprotocols,
        keys=hub.keys,
        allowed_origins=s.allowed_origins,
        secrets=hub.secrets,
        secret_use=secret_use,
        now=time.time(),
    )


def connected(hub: Hub, transport: Transport) -> None:
    hub.sockets.add(transport)
    hub.metrics.connections.labels("open").inc()


def disconnected(hub: Hub, transport: Transport) -> None:
    hub.sockets.discard(transport)
    if not hub.sockets:
        hub.no_connections.set()
    hub.metrics.connections.labels("open").dec()


def require_engine(hub: Hub) -> None:
    """Raises ``engine_unavailable`` (close 1013) unless a session can be opened now, or
    ``server_draining`` (1013) while this front end drains (duplex_server/ops/drain.py)."""
    engine = hub.sessions.engine
    if hub.draining:
        raise SessionFatal(
            "server_draining",
            "this front end is draining; resume or open elsewhere",
            close_code=CloseCode.TRY_AGAIN,
            error_type="server_error",
        )
    if hub.closing or engine is None or not engine.ready:
        restarting = not hub.closing and engine is not None and engine.restarting
        why = (
            "the engine is restarting; try again in 2 s"
            if restarting
            else "the engine is not ready"
        )
        raise SessionFatal("engine_unavailable", why, close_code=CloseCode.TRY_AGAIN)


async def open_session(
    hub: Hub, attachment: Attachment, *, beta: bool = False, patch: dict[str, Any] | None = None
) -> LiveSession:
    """A new session for ``attachment``; ``patch``: session settings applied at once (as a
    ``session.update``). Raises :class:`ProtocolError` or an engine error if refused."""
    require_engine(hub)
    session = await hub.sessions.open(attachment, hub.capabilities(), beta=beta)
    if hub.simulated:  # say why the answers are silent (a simulated GPU config)
        message = (
            f"stages {', '.join(hub.simulated)} are simulated (backend sim): answers take "
            "the time a GPU would and are silent (docs/gpu.md, 'Simulated GPU')"
        )
        session.emit(
            ev.Error(
                error=ev.ErrorDetail(type="server_error", code="simulated_stages", message=message)
            )
        )
    if patch:
        session.receive_text(json.dumps({"type": "session.update", "session": patch}))
    return session


async def resume_session(
    hub: Hub, attachment: Attachment, event: ev.SessionResume, *, prepare: Prepare | None = None
) -> LiveSession:
    """The live session ``event`` names, resumed onto ``attachment`` (``prepare``: the wire
    of a session taken over from another front end, ``Sessions.adopt``)."""
    require_engine(hub)
    return await hub.sessions.resume(attachment, event, prepare=prepare)


def refusal(exc: ProtocolError | EngineError) -> tuple[ev.ErrorDetail, int]:
    """The wire error of a refused handshake and the close code it ends with."""
    detail, close = to_wire_error(exc)
    return detail, close or CloseCode.POLICY


def outcome(hub: Hub, label: str) -> None:
    """Count a handshake's result (``opened``, ``twilio_opened``, a refusal's code, ...)."""
    hub.metrics.connection_outcomes.labels(label).inc()
