"""Server configuration: the ``server:`` section of the YAML config (every field has a default).

A bad value fails start-up with :class:`duplex_contract.errors.ConfigError` naming the field.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Literal

import msgspec

from duplex_contract.errors import ConfigError
from engine.config import EngineConfig, convert, engine_config, load_yaml

PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
PositiveFloat = Annotated[float, msgspec.Meta(gt=0)]
MiB = 1024 * 1024


class BatchConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Knobs of the batch HTTP routes (``server.batch``)."""

    #: extra ids listed by /v1/models (any model id is accepted: there is one engine)
    model_aliases: tuple[str, ...] = ()
    #: request bodies larger than this are refused with 413 (OpenAI's upload limit)
    max_body_bytes: PositiveInt = 25 * MiB


class TwilioConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Twilio Media Streams at ``/v1/twilio`` (``server.twilio``): request signing
    (docs/protocol.md §12.2)."""

    #: the Twilio account's auth token; with one (here, or in ``auth_token_env``) every
    #: upgrade must carry a valid ``X-Twilio-Signature``
    auth_token: str | None = None
    #: the environment variable read for the auth token when ``auth_token`` is not set
    auth_token_env: str = "TWILIO_AUTH_TOKEN"
    #: the stream URL exactly as the TwiML names it (``wss://host/v1/twilio``); None: the
    #: URL is rebuilt from the request (Host header, path, query)
    public_url: Annotated[str, msgspec.Meta(pattern="^wss?://[^/?#]+")] | None = None
    #: with signing on, an upgrade without a signature may still be admitted by an API key
    #: (the ``Authorization`` header or the TwiML parameter ``api_key``; needs
    #: ``server.api_keys``); false: the signature is required
    api_key_fallback: bool = True

    def token(self) -> str | None:
        """The auth token (None: signing is off)."""
        if self.auth_token:
            return self.auth_token
        env = os.environ.get(self.auth_token_env, "").strip() if self.auth_token_env else ""
        return env or None


class OtelConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """OpenTelemetry traces over OTLP/HTTP (``server.otel``; docs/protocol.md §13): one
    trace per session. Off unless ``endpoint`` is set."""

    #: the collector's OTLP/HTTP traces URL (``http://collector:4318/v1/traces``); None: off
    endpoint: Annotated[str, msgspec.Meta(pattern="^https?://[^/?#]+")] | None = None
    #: ``service.name`` of the spans (an engine process adds ``duplex.process: engine``)
    service_name: Annotated[str, msgspec.Meta(min_length=1)] = "duplex-server"
    #: the share of sessions traced (0-1), decided when a session opens; its turns and the
    #: engine's spans follow that decision
    sample_ratio: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 1.0
    #: extra HTTP headers sent with each export (a vendor's API key)
    headers: dict[str, str] = {}
    #: the most a finished span waits before it is exported (ms)
    export_delay_ms: Annotated[int, msgspec.Meta(ge=1, le=60_000)] = 2000
    #: the most ended spans waiting to go to the export child; past it spans are dropped
    #: and counted (``duplex_otel_spans{outcome="dropped"}``), never waited for
    max_queue: Annotated[int, msgspec.Meta(ge=1, le=1_000_000)] = 4096


class LiveConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The GPT-Live route ``/v1/live/sessions`` (``server.live``; docs/protocol.md,
    "GPT-Live")."""

    #: model names accepted beside ``gpt-live-1``, ``gpt-live-1.1`` and ``model_name``
    model_aliases: tuple[str, ...] = ()
    #: how the server ends a Live turn (the wire has no turn-detection setting)
    turn_detection: Literal["server_vad", "semantic_vad"] = "server_vad"
    #: semantic_vad: how soon a turn that sounds finished ends
    eagerness: Literal["low", "medium", "high", "auto"] = "auto"
    #: the silence that ends a turn (ms; None: the VAD's default, 500 for server_vad, the
    #: eagerness's longest wait for semantic_vad)
    silence_duration_ms: Annotated[int, msgspec.Meta(ge=100, le=10_000)] | None = None
    #: the barge-in rule's mode (``confirm``: an onset pauses the answer, a backchannel
    #: resumes it; the server plays a Live session's audio, as on WebRTC and Twilio)
    interruption: Literal["immediate", "confirm"] = "confirm"
    #: a Live session closes ``expired`` this long after it started
    max_session_s: PositiveFloat = 7200.0
    #: ``session.usage.updated`` every this many seconds (and on close)
    usage_interval_s: PositiveFloat = 5.0
    #: reply audio is sent at real time with at most this much ahead of the clock
    output_lead_ms: Annotated[float, msgspec.Meta(ge=20.0, le=2000.0)] = 200.0
    #: ``context_window.usage_ratio`` = the thinker's last prompt tokens / this
    context_window_tokens: PositiveInt = 8192
    #: the engine route a responses-mode delegation's backend runs on (its LLM stage)
    backend_route: str = "text"
    #: the most a backend model call may write
    backend_max_output_tokens: PositiveInt = 256


class ServerConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    api_keys: list[str] = []
    #: comma-separated keys read from this environment variable at start-up (added to api_keys)
    api_keys_env: str = "DUPLEX_API_KEYS"
    #: browser Origin allow-list; None allows any origin (non-browser clients send none)
    allowed_origins: list[str] | None = None
    #: who may read GET /metrics when API keys are set: ``keyed`` (a key, as for /v1/*; a
    #: Prometheus scrape job sends it with ``authorization: {credentials: <key>}``) or
    #: ``open`` (anyone who reaches the port). Without keys it is always open.
    metrics_access: Literal["keyed", "open"] = "keyed"
    max_frame_bytes: PositiveInt = 15 * MiB
    input_backlog_bytes: PositiveInt = 16 * MiB
    output_buffer_bytes: PositiveInt = 8 * MiB
    send_timeout_s: PositiveFloat = 5.0
    journal_max_bytes: PositiveInt = 8 * MiB
    journal_max_age_s: PositiveFloat = 60.0
    resume_wait_s: PositiveFloat = 10.0
    #: this front end's route key (1-16 of a-z, 0-9): session ids carry it
    #: (``sess_<key>_<hex>``) so a load balancer routes resumes to the owner (docs/scale.md)
    route_key: Annotated[str, msgspec.Meta(pattern="^[a-z0-9]{1,16}$")] | None = None
    vad_threads: PositiveInt = 2
    model_name: str = "duplex"
    shutdown_grace_s: PositiveFloat = 5.0
    #: SIGTERM drains the front end (docs/scale.md): /health says ``draining`` for at least
    #: ``drain_health_s`` (so a load balancer's checks take it out: HAProxy's inter x fall,
    #: and a margin) and answers in flight get up to ``drain_s`` to finish; then every
    #: session is handed over (``session.handover``, close 1012) to resume on another one
    drain_s: PositiveFloat = 10.0
    drain_health_s: Annotated[float, msgspec.Meta(ge=0)] = 2.5
    #: ``serve --workers`` starts a front end that exits again (docs/scale.md); one that
    #: exits ``restart_limit`` times within ``restart_window_s`` makes it give up (exit 1)
    restart_limit: PositiveInt = 5
    restart_window_s: PositiveFloat = 60.0
    #: a front end attached to an engine process that keeps its sessions (``engine --state``;
    #: ``serve --workers``) waits this long for it to come back when it exits, its sessions'
    #: sockets open (docs/scale.md); past it they end with ``engine_unavailable``
    engine_restart_s: PositiveFloat = 120.0
    static_dir: str = "clients/web"
    #: negotiate permessage-deflate (RFC 7692) when a client offers it. Off by default: base64
    #: audio barely compresses, and each compressed socket costs zlib CPU per frame and two
    #: zlib contexts of memory for its lifetime.
    ws_per_message_deflate: bool = False
    batch: BatchConfig = BatchConfig()
    #: STUN/TURN URLs the WebRTC transport's peer connections use (none: host candidates
    #: only, for a server the clients reach directly)
    webrtc_ice_servers: list[str] = []
    #: the addresses WebRTC offers as ICE host candidates (None: every interface's, as
    #: aioice gathers them; ["127.0.0.1"] keeps calls on loopback, as the tests do). This
    #: sets aioice's host-address lookup for the whole process.
    webrtc_host_addresses: list[str] | None = None
    #: a WebRTC call whose peer has not connected by then ends
    webrtc_connect_timeout_s: PositiveFloat = 30.0
    twilio: TwilioConfig = TwilioConfig()
    otel: OtelConfig = OtelConfig()
    live: LiveConfig = LiveConfig()

    def keys(self) -> frozenset[str]:
        env = os.environ.get(self.api_keys_env, "") if self.api_keys_env else ""
        return frozenset([*self.api_keys, *(k.strip() for k in env.split(",") if k.strip())])


class AppConfig(msgspec.Struct, frozen=True):
    engine: EngineConfig
    server: ServerConfig = ServerConfig()


def load_app_config(path: str | Path) -> AppConfig:
    raw = load_yaml(path)
    if "engine" not in raw:
        raise ConfigError("engine: missing section")
    engine = engine_config(raw["engine"])
    server = convert(raw.get("server") or {}, ServerConfig, where="server")
    return AppConfig(engine=engine, server=server)
