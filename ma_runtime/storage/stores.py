"""Which backend serves a location, built from the job's settings and the SDK's credential variables."""

import os
from typing import Mapping

from ma_runtime.errors import RuntimeFailure
from ma_runtime.storage.base import ObjectStore
from ma_runtime.storage.local import LocalStore
from ma_runtime.storage.url import Location


def open_store(location: Location, spec, environ: Mapping[str, str] = os.environ) -> ObjectStore:
    if not location.remote:
        return LocalStore()
    # Imported here: the SDK (and requests) cost start-up time that local jobs need not pay.
    from ma_runtime.storage.obs import ObsStore

    return ObsStore.from_settings(spec, environ)


def endpoint_of(spec) -> str:
    """The endpoint the job's remote locations use, as their stores and storage/reach.py name it; the setting as
    written when it is not one."""
    from ma_runtime.storage.obs.client import endpoint_url

    try:
        return endpoint_url(spec.storage_endpoint, spec.storage_use_https)
    except RuntimeFailure:
        return f"MA_S3_ENDPOINT={spec.storage_endpoint or ''}"
