"""Which backend serves a location, built from the job's settings and the SDK's credential variables."""

import os
from typing import Mapping

from ma_runtime.storage.base import ObjectStore
from ma_runtime.storage.local import LocalStore
from ma_runtime.storage.url import Location


def open_store(location: Location, spec, environ: Mapping[str, str] = os.environ) -> ObjectStore:
    if not location.remote:
        return LocalStore()
    # Imported here: the SDK (and requests) cost start-up time that local jobs need not pay.
    from ma_runtime.storage.obs import ObsStore

    return ObsStore.from_settings(spec, environ)
