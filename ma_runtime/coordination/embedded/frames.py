"""The embedded store's wire format: a frame is 4 bytes of big-endian length, then a UTF-8 JSON object; the
limits that bound what a peer can make the server hold."""

import json
import struct
from typing import Any, Dict, List

FRAME_LIMIT = 1 << 20  # bytes of one frame's body: a request or a reply
VALUE_LIMIT = 512 << 10  # bytes of one value (base64 makes it 4/3 larger in its frame)
OUTPUT_LIMIT = 4 * FRAME_LIMIT  # replies waiting for a peer that does not read them
_HEADER = struct.Struct(">I")


class FrameError(ValueError):
    """A frame over the limit, or one that is not a JSON object."""


def encode_frame(message: Dict[str, Any], limit: int = FRAME_LIMIT) -> bytes:
    body = json.dumps(message, separators=(",", ":")).encode("utf-8")
    if len(body) > limit:
        raise FrameError(f"a frame of {len(body)} bytes is over the limit of {limit}")
    return _HEADER.pack(len(body)) + body


class FrameReader:
    """Turns the bytes a connection received into messages; never holds more than one frame's limit."""

    def __init__(self, limit: int = FRAME_LIMIT):
        self._limit = limit
        self._buffer = bytearray()

    def feed(self, data: bytes) -> List[Dict[str, Any]]:
        """The messages completed by `data`; FrameError as soon as a frame announces more than the limit or is
        not a JSON object."""
        self._buffer += data
        messages = []
        while len(self._buffer) >= _HEADER.size:
            (length,) = _HEADER.unpack_from(self._buffer)
            if length > self._limit:
                raise FrameError(f"a frame of {length} bytes is over the limit of {self._limit}")
            if len(self._buffer) < _HEADER.size + length:
                break
            body = bytes(self._buffer[_HEADER.size:_HEADER.size + length])
            del self._buffer[:_HEADER.size + length]
            messages.append(_decoded(body))
        return messages


def _decoded(body: bytes) -> Dict[str, Any]:
    try:
        message = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise FrameError("a frame that is not UTF-8 JSON") from None
    if not isinstance(message, dict):
        raise FrameError("a frame that is not a JSON object")
    return message


def address_text(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
