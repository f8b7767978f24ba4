"""One file up the way the sync engine sends it (sync/engine.py): a single PUT below `large_threshold`, else a
resumable multipart upload (transfer.Multipart). The runtime itself uploads only through the sync engine; the
transfer tests drive the same parts one file at a time with this."""

from pathlib import Path

from ma_runtime.storage import transfer
from ma_runtime.storage.base import ObjectInfo, StorageError
from ma_runtime.storage.transfer.utils import naming_the_store, object_url, oserror_text
from ma_runtime.storage.url import Location


def upload_file(store, path: Path, location: Location, options: transfer.TransferOptions, log) -> ObjectInfo:
    path = Path(path).absolute()
    key = location.key + path.name if location.is_prefix else location.key
    url = object_url(location, key)
    try:
        stats = path.stat()
        if stats.st_size < options.large_threshold:
            return transfer.Calls(options, log)(store.put_file, location.bucket, key, str(path))
        return transfer.Multipart(store, location.bucket, key, url, path, stats, options, log).run()
    except StorageError as exc:
        raise naming_the_store(exc, store, location) from exc
    except OSError as exc:
        raise StorageError(f"{path} -> {url}: {oserror_text(exc)}") from exc
