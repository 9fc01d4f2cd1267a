"""The web configuration file of /metrics: TLS, mutual TLS and basic auth.

The format is the Prometheus exporter-toolkit's (``--web.config.file`` of
node_exporter and friends), so one file and one habit serve every exporter::

    tls_server_config:
      cert_file: server.crt          # relative paths: from the file's directory
      key_file: server.key
      client_ca_file: clients-ca.crt # mutual TLS (default RequireAndVerifyClientCert)
      client_auth_type: RequireAndVerifyClientCert
      min_version: TLS12
    basic_auth_users:
      prometheus: $2b$12$...         # bcrypt hash (htpasswd -nBC 12 "" | tr -d ':\\n')
    http_server_config:
      headers:
        Strict-Transport-Security: max-age=31536000

A bad file raises :class:`WebConfigError` (a ValueError) naming the key, when
the monitor is configured: never at the first scrape. Passwords are checked
with ``bcrypt`` (the ``security`` extra).
"""

from __future__ import annotations

import os
import ssl
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import yaml

__all__ = ["WebConfig", "TLSServerConfig", "WebConfigError", "load_web_config", "ENV_VAR"]

ENV_VAR = "LOSSBEAT_WEB_CONFIG"
"""Environment variable naming a web configuration file (used when none is passed)."""

# exporter-toolkit's client_auth_type values that Python's ssl can honour. Go's
# RequestClientCert / RequireAnyClientCert ask for a certificate without verifying it:
# Python's ssl verifies every certificate it asks for, and an unverified one proves nothing.
_CLIENT_AUTH = {
    "NoClientCert": ssl.CERT_NONE,
    "VerifyClientCertIfGiven": ssl.CERT_OPTIONAL,
    "RequireAndVerifyClientCert": ssl.CERT_REQUIRED,
}
_TLS_VERSIONS = {
    "TLS10": ssl.TLSVersion.TLSv1,
    "TLS11": ssl.TLSVersion.TLSv1_1,
    "TLS12": ssl.TLSVersion.TLSv1_2,
    "TLS13": ssl.TLSVersion.TLSv1_3,
}
_TLS_KEYS = {"cert_file", "key_file", "client_ca_file", "client_auth_type", "min_version", "max_version"}
# Keys of the toolkit's format that lossbeat does not implement: refused, never silently ignored.
_UNSUPPORTED = {
    "tls_server_config": {
        "cert",
        "key",
        "client_ca",
        "cipher_suites",
        "curve_preferences",
        "prefer_server_cipher_suites",
        "client_allowed_sans",
    },
}
_TOP_KEYS = {"tls_server_config", "basic_auth_users", "http_server_config"}
_HTTP_KEYS = {"headers", "http2"}


class WebConfigError(ValueError):
    """A web configuration file is malformed; the message names the file and the key."""


@dataclass(frozen=True)
class TLSServerConfig:
    cert_file: str
    """Server certificate (PEM), with its chain."""
    key_file: str
    """Server private key (PEM)."""
    client_ca_file: str | None = None
    """CA bundle client certificates must chain to (mutual TLS)."""
    client_auth_type: str = "NoClientCert"
    """NoClientCert, VerifyClientCertIfGiven or RequireAndVerifyClientCert."""
    min_version: str = "TLS12"
    """Lowest protocol accepted: TLS10..TLS13."""
    max_version: str = "TLS13"
    """Highest protocol accepted."""

    def ssl_context(self) -> ssl.SSLContext:
        """A server context from the files as they are now (raises WebConfigError)."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = _TLS_VERSIONS[self.min_version]
        context.maximum_version = _TLS_VERSIONS[self.max_version]
        try:
            context.load_cert_chain(self.cert_file, self.key_file)
        except (OSError, ssl.SSLError) as exc:
            raise WebConfigError(
                f"tls_server_config.cert_file/key_file: cannot load {self.cert_file} with {self.key_file}: {exc}"
            ) from exc
        context.verify_mode = _CLIENT_AUTH[self.client_auth_type]
        if self.client_ca_file is not None:
            try:
                context.load_verify_locations(cafile=self.client_ca_file)
            except (OSError, ssl.SSLError) as exc:
                raise WebConfigError(
                    f"tls_server_config.client_ca_file: cannot load {self.client_ca_file}: {exc}"
                ) from exc
        return context

    def files(self) -> tuple[str, ...]:
        return tuple(f for f in (self.cert_file, self.key_file, self.client_ca_file) if f is not None)


@dataclass(frozen=True)
class WebConfig:
    tls: TLSServerConfig | None = None
    """TLS settings; None serves plain HTTP."""
    basic_auth_users: Mapping[str, str] = field(default_factory=dict)
    """User name to bcrypt hash; empty means no authentication."""
    headers: Mapping[str, str] = field(default_factory=dict)
    """Extra response headers (``http_server_config.headers``)."""
    source: str = "<web config>"
    """Where the settings came from, for messages."""

    @classmethod
    def from_tls_files(cls, certfile: str, keyfile: str) -> WebConfig:
        """The settings of MonitorConfig's certfile/keyfile: TLS, no client authentication."""
        tls = TLSServerConfig(str(certfile), str(keyfile))
        tls.ssl_context()  # fail now, naming the files, not at the first scrape
        return cls(tls, source="certfile/keyfile")


def load_web_config(path: str | os.PathLike[str]) -> WebConfig:
    """Read and validate a web configuration file (exporter-toolkit format)."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"web_config: expected a path, got {type(path).__name__}")
    source = os.fspath(path)
    try:
        with open(source, encoding="utf-8") as fh:
            doc = yaml.safe_load(fh)  # safe_load only: a config file never constructs objects
    except (OSError, UnicodeDecodeError) as exc:
        raise WebConfigError(f"{source}: cannot read web config file: {exc}") from exc
    except yaml.YAMLError as exc:
        raise WebConfigError(f"{source}: not valid YAML: {exc}") from exc
    return parse_web_config({} if doc is None else doc, source, os.path.dirname(os.path.abspath(source)))


def parse_web_config(doc: Any, source: str = "<web config>", directory: str = ".") -> WebConfig:
    """Validate a parsed document; relative file paths are taken from ``directory``."""

    def fail(key: str, problem: str) -> WebConfigError:
        return WebConfigError(f"{source}: {key}: {problem}")

    if not isinstance(doc, Mapping):
        raise fail("(top level)", f"expected a mapping, got {type(doc).__name__}")
    _no_unknown(doc, _TOP_KEYS, "", fail)

    tls = None
    tls_doc = doc.get("tls_server_config")
    if tls_doc is not None:
        tls = _tls(tls_doc, directory, fail)

    users: dict[str, str] = {}
    users_doc = doc.get("basic_auth_users")
    if users_doc is not None:
        if not isinstance(users_doc, Mapping):
            raise fail("basic_auth_users", "expected a mapping of user name to bcrypt hash")
        for user, hashed in users_doc.items():
            where = f"basic_auth_users.{user}"
            if not isinstance(user, str) or not user or ":" in user:
                raise fail(where, "a user name is a non-empty string without ':'")
            if not isinstance(hashed, str) or not _is_bcrypt_hash(hashed):
                raise fail(
                    where,
                    "expected a bcrypt hash ($2a$, $2b$ or $2y$, 60 characters), "
                    "e.g. from `htpasswd -nBC 12 USER`; never a plain password",
                )
            users[user] = hashed
        if users:
            require_bcrypt()

    headers: dict[str, str] = {}
    http_doc = doc.get("http_server_config")
    if http_doc is not None:
        if not isinstance(http_doc, Mapping):
            raise fail("http_server_config", "expected a mapping")
        _no_unknown(http_doc, _HTTP_KEYS, "http_server_config.", fail)
        if "http2" in http_doc and not isinstance(http_doc["http2"], bool):
            raise fail("http_server_config.http2", "expected true or false")  # HTTP/1.1 is served either way
        header_doc = http_doc.get("headers") or {}
        if not isinstance(header_doc, Mapping):
            raise fail("http_server_config.headers", "expected a mapping of header to value")
        for name, value in header_doc.items():
            if not isinstance(name, str) or not isinstance(value, str) or not _is_header_safe(name + value):
                raise fail(f"http_server_config.headers.{name}", "expected a string header and value, one line each")
            headers[name] = value

    return WebConfig(tls, users, headers, source)


def require_bcrypt() -> Any:
    """The bcrypt module, or an ImportError that says how to install it."""
    try:
        import bcrypt
    except ImportError as exc:
        raise ImportError(
            "lossbeat: basic_auth_users in the web config needs the bcrypt package: pip install 'lossbeat[security]'"
        ) from exc
    return bcrypt


def _tls(doc: Any, directory: str, fail: Callable[[str, str], WebConfigError]) -> TLSServerConfig:
    if not isinstance(doc, Mapping):
        raise fail("tls_server_config", "expected a mapping")
    for key in doc:
        if key in _UNSUPPORTED["tls_server_config"]:
            raise fail(
                f"tls_server_config.{key}",
                "not supported by lossbeat (use the *_file keys; protocol versions via min_version/max_version)",
            )
    _no_unknown(doc, _TLS_KEYS, "tls_server_config.", fail)
    values: dict[str, Any] = {}
    for key in ("cert_file", "key_file", "client_ca_file"):
        value = doc.get(key)
        if value is None or value == "":
            continue
        if not isinstance(value, str):
            raise fail(f"tls_server_config.{key}", f"expected a file path, got {value!r}")
        values[key] = os.path.join(directory, value)
    for key in ("cert_file", "key_file"):
        if key not in values:
            raise fail(f"tls_server_config.{key}", "required when tls_server_config is given")
    auth = doc.get("client_auth_type")
    if auth is None or auth == "":
        # The toolkit's default: a client CA means clients must present a certificate it signed.
        auth = "RequireAndVerifyClientCert" if "client_ca_file" in values else "NoClientCert"
    if auth not in _CLIENT_AUTH:
        hint = (
            " (Python's ssl verifies every client certificate it asks for: use VerifyClientCertIfGiven"
            " or RequireAndVerifyClientCert)"
            if auth in ("RequestClientCert", "RequireAnyClientCert")
            else ""
        )
        raise fail(
            "tls_server_config.client_auth_type", f"expected one of {', '.join(_CLIENT_AUTH)}, got {auth!r}{hint}"
        )
    if auth != "NoClientCert" and "client_ca_file" not in values:
        raise fail("tls_server_config.client_ca_file", f"required with client_auth_type {auth}")
    values["client_auth_type"] = auth
    for key, default in (("min_version", "TLS12"), ("max_version", "TLS13")):
        version = doc.get(key) or default
        if version not in _TLS_VERSIONS:
            raise fail(f"tls_server_config.{key}", f"expected one of {', '.join(_TLS_VERSIONS)}, got {version!r}")
        values[key] = version
    if _TLS_VERSIONS[values["min_version"]] > _TLS_VERSIONS[values["max_version"]]:
        raise fail("tls_server_config.min_version", "must not be above max_version")
    config = TLSServerConfig(**values)
    try:
        config.ssl_context()  # unreadable or mismatched files fail now, naming the key
    except WebConfigError as exc:
        raise fail(*str(exc).split(": ", 1)) from exc
    return config


def _no_unknown(
    doc: Mapping[object, object], known: set[str], prefix: str, fail: Callable[[str, str], WebConfigError]
) -> None:
    unknown = sorted(str(k) for k in doc if k not in known)
    if unknown:
        raise fail(f"{prefix}{unknown[0]}", f"unknown key (known: {', '.join(sorted(known))})")


def _is_bcrypt_hash(value: str) -> bool:
    return len(value) == 60 and value[:4] in ("$2a$", "$2b$", "$2y$") and value[4:6].isdigit() and value[6] == "$"


def _is_header_safe(text: str) -> bool:
    return "\r" not in text and "\n" not in text
