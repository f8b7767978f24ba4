"""Test doubles shared by the storage and sync tests: a logger that keeps what it is told, and a store wrapper."""

import threading


class Log:
    """A structlog-style logger that keeps (level, event, fields)."""

    def __init__(self):
        self.records = []
        self.lock = threading.Lock()

    def _add(self, level, event, **fields):
        with self.lock:
            self.records.append((level, event, fields))

    def debug(self, event, **fields):
        self._add("debug", event, **fields)

    def info(self, event, **fields):
        self._add("info", event, **fields)

    def warning(self, event, **fields):
        self._add("warning", event, **fields)

    def error(self, event, **fields):
        self._add("error", event, **fields)

    def events(self, level=None):
        with self.lock:
            return [event for lvl, event, _ in self.records if level in (None, lvl)]

    def fields(self, event, level=None):
        with self.lock:
            return [f for lvl, e, f in self.records if e == event and level in (None, lvl)]


class Wrapper:
    """Passes every call to the wrapped store; subclasses override what they change."""

    def __init__(self, store):
        self.inner = store
        self.lock = threading.Lock()

    def __getattr__(self, name):
        return getattr(self.inner, name)
