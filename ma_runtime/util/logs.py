"""The runtime's own log lines: structlog, configured once, masked, platform-styled.

Default format is logfmt in the platform's style
(`time="..." level=info msg="..." Component=ma-runtime key=value`), or one JSON
object per line with MA_RUNTIME_LOG_FORMAT=json. Lines go to stderr and, once
it is open, to the task log, through the same `Sink`s that carry worker output,
so a runtime line is never spliced into a worker line.
"""

import importlib
import itertools
import json
import re
import shlex
import sys
import types
from typing import Any, Dict, List, Optional


class _OnFirstUse(types.ModuleType):
    """Stands in for a module until something reads from it, then imports it and hands over.

    structlog imports asyncio (~20 ms, a fifth of the start-up) for its async logging methods,
    which the runtime never calls; structlog only reads `asyncio.<name>` inside them. (The
    standard `importlib.util.LazyLoader` does not help here: the import statement itself reads
    the module's `__spec__`, which loads it.) Only this process sees the stand-in: the command
    and its workers are other processes.
    """

    def __getattr__(self, name: str) -> Any:
        real = sys.modules.get(self.__name__)
        if real is None or real is self:
            del sys.modules[self.__name__]
            real = importlib.import_module(self.__name__)
        self.__dict__.update(real.__dict__)
        return getattr(real, name)


# What structlog probes for at import, for features the runtime never uses (pretty console tracebacks, colours,
# Twisted, greenlet-local context), whichever the image happens to have installed: rich alone costs ~130 ms of
# start-up where present (typer, huggingface_hub's CLI and many training images bring it). Hidden while structlog
# imports (a None in sys.modules is an import that fails), so structlog takes its "not installed" branch; removed
# after, so nothing else in this process is affected.
_OPTIONAL_FOR_STRUCTLOG = ("rich", "better_exceptions", "colorama", "twisted", "greenlet")


def _import_structlog() -> types.ModuleType:
    if "asyncio" not in sys.modules:
        sys.modules["asyncio"] = _OnFirstUse("asyncio")
    hidden = [name for name in _OPTIONAL_FOR_STRUCTLOG if name not in sys.modules]
    sys.modules.update(dict.fromkeys(hidden))
    try:
        return importlib.import_module("structlog")
    finally:
        for name in hidden:
            if sys.modules.get(name, ...) is None:
                del sys.modules[name]


structlog = _import_structlog()

from ma_runtime.util import output  # noqa: E402
from ma_runtime.util.output import Sink  # noqa: E402
from ma_runtime.util.redact import Masker  # noqa: E402

COMPONENT = "ma-runtime"
_LEVELS = {"debug": 10, "info": 20, "warning": 30, "error": 40, "critical": 50}
# Keys that lead every logfmt line, in this order (the platform's own lines start so).
_LEAD_KEYS = ("time", "level", "msg", "Component")
# shlex.quote's own test: a word with none of these is written as it is.
_NEEDS_QUOTING = re.compile(r"[^\w@%+=:,./-]", re.ASCII)


class _Outputs:
    """Where log lines go; a module-level singleton so handlers can add the task log late."""

    def __init__(self) -> None:
        # fd 2 itself, not sys.stderr: the entry points reopen closed standard descriptors on
        # /dev/null first thing, but Python may have set sys.stderr to None before that.
        self.sinks: List[Sink] = [Sink(2, "<stderr>")]
        self.render: Any = None  # the configured renderer, for lines written outside structlog
        self.masker: Optional[Masker] = None


_outputs = _Outputs()


class SinkLogger:
    """structlog's final logger: writes each rendered line to every sink at once."""

    def msg(self, line: str) -> None:
        data = (line + "\n").encode("utf-8", "backslashreplace")
        for sink in _outputs.sinks:
            sink.write(data)

    debug = info = warning = warn = error = critical = exception = fatal = log = msg


def _masking(masker: Masker):
    def processor(_logger: Any, _method: str, event: Dict[str, Any]) -> Dict[str, Any]:
        return {key: masker.data(value, key) for key, value in event.items()}

    return processor


def _platform_names(_logger: Any, _method: str, event: Dict[str, Any]) -> Dict[str, Any]:
    event["msg"] = event.pop("event", "")
    event["Component"] = COMPONENT
    return event


def render_logfmt(_logger: Any, _method: str, event: Dict[str, Any]) -> str:
    keys = [k for k in _LEAD_KEYS if k in event] + [k for k in event if k not in _LEAD_KEYS and event[k] is not None]
    return " ".join(f"{key}={_logfmt_value(key, event[key])}" for key in keys)


def _logfmt_value(key: str, value: Any) -> str:
    if value is None:
        return '""'
    if isinstance(value, (list, tuple)) and all(map(isinstance, value, itertools.repeat(str))):
        value = _command_line(value)  # a command line reads best as one
    if isinstance(value, bool):
        return "true" if value else "false"
    if not isinstance(value, str):
        value = value if isinstance(value, (int, float)) else json.dumps(value, default=str)
        value = str(value)
    # time and msg are always quoted, as in the platform's own lines.
    if key in ("time", "msg") or not value or any(c in value for c in ' ="\\\n\t'):
        return json.dumps(value, ensure_ascii=False)
    return value


def _command_line(words) -> str:
    """`shlex.join(words)`, its test for a word that needs quoting done once over all the words: a command line
    of 40 000 hyperparameters is one pass, not 40 000 calls."""
    if all(words) and not _NEEDS_QUOTING.search("".join(words)):
        return " ".join(words)
    return shlex.join(words)


class _SinkReporter(output.Reporter):
    """Sinks' troubles as runtime log lines (a failed task log, a console whose reader left)."""

    def warn(self, message: str, **fields: Any) -> None:
        get_logger().warning(message, **fields)

    def line(self, message: str, level: str = "info", **fields: Any) -> bytes:
        """A line in the configured format, for a sink to write into itself (it cannot log through itself)."""
        event = {"time": _now(), "level": level, "msg": message, "Component": COMPONENT, **fields}
        masker = _outputs.masker or Masker()
        event = {key: masker.data(value, key) for key, value in event.items()}
        render = _outputs.render or render_logfmt
        return (render(None, level, event) + "\n").encode("utf-8", "backslashreplace")


def _now() -> str:
    import datetime

    return datetime.datetime.now(datetime.timezone.utc).isoformat().replace("+00:00", "Z")


def configure(log_format: str = "logfmt", level: str = "info", masker: Optional[Masker] = None) -> None:
    """(Re)configures structlog for the whole process; cheap enough to call twice."""
    renderer = render_logfmt if log_format == "logfmt" else structlog.processors.JSONRenderer(default=str)
    _outputs.render, _outputs.masker = renderer, masker
    output.set_reporter(_SinkReporter())
    structlog.configure(
        processors=[
            structlog.processors.TimeStamper(fmt="iso", utc=True, key="time"),
            structlog.processors.add_log_level,
            _platform_names,
            _masking(masker or Masker.from_environ()),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level]),
        logger_factory=lambda *args: SinkLogger(),
        cache_logger_on_first_use=False,
    )


def add_sink(sink: Sink) -> None:
    _outputs.sinks.append(sink)


def remove_sink(sink: Sink) -> None:
    if sink in _outputs.sinks:
        _outputs.sinks.remove(sink)


def stderr_sink() -> Sink:
    return _outputs.sinks[0]


def get_logger(**context: Any):
    # The lazy proxy reads the configuration at each call, so a logger taken
    # before `configure` (early errors) still follows the job's level and format.
    return structlog.get_logger(**context)
