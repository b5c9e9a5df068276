"""Streaming multipart/form-data parsing with limits, for POST /v1/references.

The parser is python-multipart's (the one Starlette and FastAPI use), fed chunk by chunk as the
body arrives; each chunk is parsed in a worker thread, since scanning megabytes for a boundary is
CPU work that must not stall the ingress's event loop. The form is checked while it streams, so a
hostile body fails at its first offending part, not after it was read whole:

- at most `max_parts` parts and `max_header_bytes` of headers per part;
- only the expected names, each once, each within its own size bound;
- errors are short: they name the first offending part (its position and name) and the count.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header

from snapref_ray.serve.api import ECHO_CHARS, echo
from snapref_ray.serve.errors import ApiError


@dataclass
class FormPart:
    name: str
    index: int  # 1-based position in the body
    filename: str | None = None
    data: bytearray = field(default_factory=bytearray)


class MultipartForm:
    """One multipart body: `await form.feed(chunks)`, then `form.parts` ({name: FormPart}).

    `limits` maps each accepted part name to its largest size in bytes, and `too_large_status`
    the status a part over it gets (413 for the file, 400 for text fields). A name in `repeatable`
    may come up to that many times (`image[]`, as the OpenAI SDK sends a list of files); all of its
    parts are in `form.repeated[name]`, in order, and the first also in `form.parts`.
    """

    def __init__(
        self,
        content_type: str,
        limits: dict[str, int],
        *,
        max_parts: int,
        max_header_bytes: int,
        too_large_status: dict[str, int] | None = None,
        repeatable: dict[str, int] | None = None,
    ) -> None:
        _, params = parse_options_header(content_type)
        boundary = params.get(b"boundary")
        if not boundary:
            raise ApiError(400, "Content-Type", "multipart/form-data without a boundary parameter")
        if len(boundary) > 200:  # RFC 2046: at most 70 characters
            raise ApiError(400, "Content-Type", f"a multipart boundary of {len(boundary)} characters (at most 70)")
        self._limits = limits
        self._status = too_large_status or {}
        self._max_parts, self._max_header_bytes = max_parts, max_header_bytes
        self._repeatable = repeatable or {}
        self.parts: dict[str, FormPart] = {}
        self.repeated: dict[str, list[FormPart]] = {}
        self.count = 0
        self._part: FormPart | None = None
        self._header_name, self._header_value = bytearray(), bytearray()
        self._headers: dict[bytes, bytes] = {}
        self._header_bytes = 0
        self._ended = False
        self._parser = MultipartParser(
            boundary,
            callbacks={
                "on_part_begin": self._on_part_begin,
                "on_header_field": self._on_header_field,
                "on_header_value": self._on_header_value,
                "on_header_end": self._on_header_end,
                "on_headers_finished": self._on_headers_finished,
                "on_part_data": self._on_part_data,
                "on_end": self._on_end,
            },
        )

    async def feed(self, chunks: AsyncIterator[bytes]) -> None:
        """Parse the body as it arrives (each chunk in a worker thread); raises ApiError at the first fault."""
        async for chunk in chunks:
            await asyncio.to_thread(self._write, chunk)
        if not self._ended:
            raise ApiError(
                400, "body", f"malformed multipart body: it ends before the closing boundary ({self.count} parts seen)"
            )

    def _write(self, chunk: bytes) -> None:
        try:
            self._parser.write(chunk)
        except MultipartParseError as e:
            raise ApiError(400, "body", f"malformed multipart body after {self.count} parts: {str(e)[:120]}") from None

    # -- python-multipart callbacks (run in the worker thread, one chunk at a time) -----------
    def _on_part_begin(self) -> None:
        self.count += 1
        if self.count > self._max_parts:
            raise ApiError(
                400, "body", f"part {self.count} is more than the {self._max_parts} parts accepted in one upload"
            )
        self._headers, self._header_bytes = {}, 0

    def _add_header_bytes(self, n: int) -> None:
        self._header_bytes += n
        if self._header_bytes > self._max_header_bytes:
            raise ApiError(400, "body", f"part {self.count} has more than {self._max_header_bytes} bytes of headers")

    def _on_header_field(self, data: bytes, start: int, end: int) -> None:
        self._add_header_bytes(end - start)
        self._header_name += data[start:end]

    def _on_header_value(self, data: bytes, start: int, end: int) -> None:
        self._add_header_bytes(end - start)
        self._header_value += data[start:end]

    def _on_header_end(self) -> None:
        self._headers[bytes(self._header_name).lower()] = bytes(self._header_value)
        self._header_name, self._header_value = bytearray(), bytearray()

    def _on_headers_finished(self) -> None:
        disposition, params = parse_options_header(self._headers.get(b"content-disposition", b""))
        raw_name = params.get(b"name")
        if disposition != b"form-data" or raw_name is None:
            raise ApiError(400, "body", f"part {self.count} has no 'Content-Disposition: form-data; name=...' header")
        name = raw_name.decode("latin-1")
        if name not in self._limits:
            raise ApiError(
                400,
                name[:ECHO_CHARS],
                f"part {self.count} is named {echo(name)}; an upload takes only {', '.join(self._limits)}",
            )
        filename = params.get(b"filename")
        part = FormPart(name, self.count, filename.decode("latin-1") if filename else None)
        if name in self._repeatable:
            parts = self.repeated.setdefault(name, [])
            if len(parts) == self._repeatable[name]:
                raise ApiError(
                    400, name, f"part {self.count} is {name!r} number {len(parts) + 1}; at most {len(parts)} accepted"
                )
            parts.append(part)
            self.parts.setdefault(name, part)
        elif name in self.parts:
            raise ApiError(
                400, name, f"part {self.count} repeats {name!r} (first sent as part {self.parts[name].index})"
            )
        else:
            self.parts[name] = part
        self._part = part

    def _on_part_data(self, data: bytes, start: int, end: int) -> None:
        part = self._part
        assert part is not None  # python-multipart sends data only after the headers
        part.data += data[start:end]
        limit = self._limits[part.name]
        if len(part.data) > limit:
            raise ApiError(
                self._status.get(part.name, 400),
                part.name,
                f"part {part.index} ({part.name!r}) exceeds the {limit} bytes accepted",
            )

    def _on_end(self) -> None:
        self._ended = True

    # -- results ------------------------------------------------------------------------------
    def text(self, name: str) -> str | None:
        """A text part decoded as UTF-8 (400 naming the part otherwise); None when it was not sent."""
        part = self.parts.get(name)
        if part is None:
            return None
        try:
            return part.data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ApiError(400, name, f"part {part.index} ({name!r}) is not UTF-8 text (byte {e.start})") from None
