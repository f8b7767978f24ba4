"""The SDK's ObsClient as the settings make it (obs/__init__.py: endpoint, credentials, region, path style,
signature, retries, timeout), and the credentials read from the environment."""

import ipaddress
import unicodedata
import warnings
from typing import Any, Dict, Mapping, Optional, Tuple
from urllib.parse import urlsplit

from obs import ObsClient

from ma_runtime.errors import ConfigError
from ma_runtime.storage.base import (
    StorageError,
)
from ma_runtime.util.credentials import ACCESS_KEY_VARIABLE, SECRET_KEY_VARIABLE, TOKEN_VARIABLE
from ma_runtime.util.redact import Masker

try:  # requests (an SDK dependency) brings urllib3, whose errors are not all OSErrors
    from urllib3.exceptions import HTTPError as Urllib3Error
except ImportError:  # pragma: no cover - urllib3 comes with the SDK
    Urllib3Error = OSError


CREDENTIAL_SOURCE = f"{ACCESS_KEY_VARIABLE}/{SECRET_KEY_VARIABLE}"


TIMEOUT_SECONDS = 60
MIN_TIMEOUT_SECONDS = 1.0  # below this, a healthy endpoint's answers would time out too
DEFAULT_REGION = "us-east-1"
HUAWEI_DOMAINS = ("myhuaweicloud.com", "huaweicloud.com")


def endpoint_url(configured: Optional[str], use_https: bool) -> str:
    endpoint = (configured or "").strip().rstrip("/")
    if not endpoint:
        raise StorageError("no OBS endpoint: set MA_S3_ENDPOINT or storage.endpoint in the job file")
    if _has_control_character(endpoint):
        raise ConfigError(f"MA_S3_ENDPOINT {ascii(endpoint)[:120]} contains a control character (a newline, tab "
                          "or NUL)", hint="write the endpoint on one line", stage="stage-in")
    if "://" not in endpoint:
        endpoint = ("https://" if use_https else "http://") + endpoint
    return endpoint


def share_crc_tables() -> None:
    """Builds the SDK's CRC-64 tables once instead of once per response.

    Every answer the SDK parses gets a `ResponseWrapper` whose `util.Crc64()` builds a
    256-entry CRC table and a combine function in pure Python: ~0.3 ms of CPU per GET,
    a fifth of a small object's cost here (benchmarks/storage.py), for a checksum our
    read path never consults. Each instance gets a copy of a prebuilt table instead.
    """
    from obs import util

    if getattr(util.Crc64, "shared_by_ma_runtime", False):
        return
    original = util.Crc64
    templates: Dict[int, Any] = {}

    class SharedCrc64(original):
        shared_by_ma_runtime = True

        def __init__(self, init_crc: int = 0):
            template = templates.get(init_crc)
            if template is None:
                template = templates[init_crc] = original(init_crc)
            self.crc64 = template.crc64.copy()
            self.crc64_combineFun = template.crc64_combineFun

    util.Crc64 = SharedCrc64


def socket_timeout(retry_seconds: float) -> float:
    """The timeout of each socket operation: the SDK's 60 s, but never past the retry budget."""
    return max(MIN_TIMEOUT_SECONDS, min(float(TIMEOUT_SECONDS), retry_seconds))


def new_client(spec, endpoint: str, access_key: str, secret_key: str, token: Optional[str],
               masker: Masker, timeout: float = TIMEOUT_SECONDS) -> ObsClient:
    share_crc_tables()
    host = urlsplit(endpoint).hostname or ""
    try:
        with warnings.catch_warnings():
            # The SDK builds its SSLContext with the deprecated PROTOCOL_SSLv23 name; nothing to act on.
            warnings.simplefilter("ignore", DeprecationWarning)
            client = ObsClient(
                access_key_id=access_key,
                secret_access_key=secret_key,
                security_token=token,
                server=endpoint,
                signature=spec.storage_signature,
                region=signing_region(spec.storage_region, host),
                path_style=uses_path_style(spec.storage_path_style, host),
                ssl_verify=spec.storage_verify_ssl,
                max_retry_count=0,  # the transfer engine retries, with its own deadline
                timeout=timeout,
                is_signature_negotiation=False,  # the configured signature, not an unauthenticated probe's
            )
    except Exception as exc:  # the SDK raises bare Exception for a malformed server
        raise StorageError(masker.text(f"OBS endpoint {endpoint}: {one_line(exc)}")) from None
    if spec.storage_verify_ssl:
        _verify_certificates(client)
    return client


def read_credentials(environ: Mapping[str, str]) -> Tuple[str, str, Optional[str]]:
    """(access key, secret key, token or None); raises StorageError naming the missing variables only, and
    ConfigError naming a variable whose value holds a control character (never the value)."""
    missing = [name for name in (ACCESS_KEY_VARIABLE, SECRET_KEY_VARIABLE) if not environ.get(name)]
    if missing:
        raise StorageError(f"no OBS credentials: {' and '.join(missing)} not set",
                           hint=f"set {ACCESS_KEY_VARIABLE} and {SECRET_KEY_VARIABLE} (and {TOKEN_VARIABLE} for "
                                "temporary credentials)")
    for name in (ACCESS_KEY_VARIABLE, SECRET_KEY_VARIABLE, TOKEN_VARIABLE):
        if _has_control_character(environ.get(name) or ""):
            raise ConfigError(f"{name} contains a control character (a newline, carriage return, tab or NUL)",
                              hint=f"set {name} to the credential alone, on one line", stage="stage-in")
    return environ[ACCESS_KEY_VARIABLE], environ[SECRET_KEY_VARIABLE], environ.get(TOKEN_VARIABLE) or None


def _has_control_character(value: str) -> bool:
    return any(unicodedata.category(char) == "Cc" for char in value)


def signing_region(configured: str, host: str) -> str:
    if configured:
        return configured
    labels = host.lower().split(".")
    # obs.<region>.<domain>.<tld>; fewer labels (obs.example.com) name no region.
    if len(labels) >= 4 and labels[0] == "obs" and not _is_ip(host):
        return labels[1]
    return DEFAULT_REGION


def uses_path_style(setting: str, host: str) -> bool:
    if setting in ("on", "off"):
        return setting == "on"
    host = host.lower()
    is_huawei = any(host == domain or host.endswith("." + domain) for domain in HUAWEI_DOMAINS)
    # Virtual-host style needs DNS for bucket.<host>: Huawei's endpoints have it, IPs and others may not.
    return _is_ip(host) or not is_huawei


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    return True


def _verify_certificates(client: ObsClient) -> None:
    # The SDK builds its own SSLContext with CERT_REQUIRED but loads no trust store (unless
    # ssl_verify is a CA file path) and turns hostname checking off: give it both.
    context = getattr(client, "context", None)
    if context is not None:
        context.load_default_certs()
        context.check_hostname = True


def one_line(value: object) -> str:
    return " ".join(str(value).split()) or type(value).__name__
