"""The runtime's own log lines: structlog, configured once, masked, platform-styled.

Default format is logfmt in the platform's style
(`time="..." level=info msg="..." Component=ma-runtime key=value`), or one JSON
object per line with MA_RUNTIME_LOG_FORMAT=json. Lines go to stderr and, once
it is open, to the task log, through the same `Sink`s that carry worker output,
so a runtime line is never spliced into a worker line.
"""

import json
import shlex
import sys
from typing import Any, Dict, List, Optional

import structlog

from ma_runtime.output import Sink
from ma_runtime.redact import Masker

COMPONENT = "ma-runtime"
_LEVELS = {"debug": 10, "info": 20, "warning": 30, "error": 40, "critical": 50}
# Keys that lead every logfmt line, in this order (the platform's own lines start so).
_LEAD_KEYS = ("time", "level", "msg", "Component")


class _Outputs:
    """Where log lines go; a module-level singleton so handlers can add the task log late."""

    def __init__(self) -> None:
        self.sinks: List[Sink] = [Sink(sys.stderr.fileno(), "<stderr>")]


_outputs = _Outputs()


class SinkLogger:
    """structlog's final logger: writes each rendered line to every sink at once."""

    def msg(self, line: str) -> None:
        data = (line + "\n").encode("utf-8", "replace")
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
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        value = shlex.join(value)  # a command line reads best as one
    if isinstance(value, bool):
        return "true" if value else "false"
    if not isinstance(value, str):
        value = value if isinstance(value, (int, float)) else json.dumps(value, default=str)
        value = str(value)
    # time and msg are always quoted, as in the platform's own lines.
    if key in ("time", "msg") or not value or any(c in value for c in ' ="\\\n\t'):
        return json.dumps(value, ensure_ascii=False)
    return value


def configure(log_format: str = "logfmt", level: str = "info", masker: Optional[Masker] = None) -> None:
    """(Re)configures structlog for the whole process; cheap enough to call twice."""
    renderer = render_logfmt if log_format == "logfmt" else structlog.processors.JSONRenderer(default=str)
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
