"""`POST /v1/audio/transcriptions` and `/v1/audio/translations` (to English): a speech model's
(Whisper's) upload, as vLLM serves them.

The body is `multipart/form-data` (RFC 7578): the audio in `file`, and text fields beside it
(`model`, `language`, `prompt`, `response_format`, `temperature`, `stream`, ...). It is read
here over the bytes already read, within the body limit (`server.max_body_bytes`, 413 past it),
without copying the audio: each part's bounds are found with `bytes.find`, at C speed, and only
the text fields are decoded, at most `MAX_PARTS` of them. A body that is not such a form is a
400 in OpenAI's error shape. Upstream the body goes byte for byte as it came, content type and
boundary included; only a `model` the gateway rewrites (an alias) is spliced in, in place of
the client's value: no part is re-encoded.

What admission charges: the text `prompt` (vLLM puts it before the decoder's prompt), counted
with the model's tokenizer when given, and an expected output, learned from the tenant's earlier
answers on the same prompt and model, else the model's `default_output_tokens`. The audio's
duration is unknown to the gateway (finding it would mean decoding every format vLLM takes), and
with it the encoder's work and the number of 30-second windows vLLM splits it into, each
generating up to `max_completion_tokens`: so the client's `max_completion_tokens` is no bound on
the whole answer, the gateway writes none, and the pool's slot (not its token count) is what
bounds the work in flight. A whole answer carries no token count (vLLM's `usage` is the audio's
seconds): the gateway counts its text itself (`count_answer`, the `text` of a JSON answer, the
body of a `text`, `srt` or `vtt` one, without special tokens) and settles on that, whole: a
reservation cannot bound what an audio of unknown length produces, so settling on it would let
a tenant's long uploads take many times its TPM. Uploads admitted at once are each charged as
it ends: together they may take the window past the TPM by what they produced beyond their
reservations, as far as the pool's slots let them run at once. A stream is settled on its
chunks, or on the counts vLLM streams when the client asks for them (`stream_include_usage`).
"""

from __future__ import annotations

import asyncio
import logging
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson

from gateway.api.fields import check_prompt_chars
from gateway.api.json_body import media_type
from gateway.api.openai import OpenAIApi
from gateway.context.endpoint import FINGERPRINT_CHARS
from gateway.errors import BadRequest, UnsupportedMediaType
from gateway.tokenizer.chat_template import lax_bool

if TYPE_CHECKING:
    from gateway.config.schema import ServerSpec
    from gateway.context.ctx import Ctx
    from gateway.tokenizer.counters import TokenCounter

FORM = "multipart/form-data"
MAX_PARTS = 256  # vLLM's forms have a few dozen fields: past this, a body is not one of them
_MAX_HEAD = 4096  # a part's headers: a name, a file name, a content type
_CRLF = b"\r\n"
_HEAD_END = b"\r\n\r\n"
log = logging.getLogger("gateway.api.audio")
# An answer over this is decoded on a thread: parsing it whole could hold the loop for long.
INLINE_DECODE_BYTES = 32_768

_PARAM = re.compile(r';\s*([A-Za-z0-9_*-]+)\s*=\s*("(?:[^"\\]|\\.)*"|[^;\s]*)')
# The fields the gateway reads: given twice, which one the replica reads is its parser's choice.
_READ = ("model", "prompt", "stream", "stream_include_usage", "file")


def _params(value: str) -> dict[str, str]:
    """The parameters of a header value (`; name="file"; filename="a.wav"`), unquoted."""
    found: dict[str, str] = {}
    for match in _PARAM.finditer(value):
        raw = match[2]
        if raw.startswith('"'):
            raw = re.sub(r"\\(.)", r"\1", raw[1:-1])
        name = match[1].lower()
        if name in found:  # which one the replica's parser reads is its choice, not ours
            raise _malformed(f"a part's Content-Disposition gives {name!r} twice")
        found[name] = raw
    return found


@dataclass(frozen=True, slots=True)
class Upload:
    """A file part: its name, and where its bytes are in the body (never copied)."""

    filename: str
    start: int
    end: int


class Form(dict[str, Any]):
    """A form's fields by name (text as `str`, a file as an `Upload`), the first of each name,
    and where each text value is in the body (`spans`), for a splice upstream."""

    __slots__ = ("repeated", "spans")

    def __init__(self) -> None:
        super().__init__()
        self.spans: dict[str, tuple[int, int]] = {}
        self.repeated: set[str] = set()


def _malformed(why: str) -> BadRequest:
    return BadRequest(f"the body is not a valid multipart form: {why}", code="invalid_multipart")


def _boundary(content_type: str) -> bytes:
    if media_type(content_type) != FORM:
        raise UnsupportedMediaType(f"Content-Type must be {FORM}, got {content_type or 'none'!r}")
    boundary = _params(content_type).get("boundary", "")
    if not 0 < len(boundary) <= 70:  # RFC 2046, 5.1.1
        raise _malformed("its Content-Type has no valid boundary")
    return boundary.encode("latin-1", "replace")


def _part(raw: bytes, start: int, end: int, form: Form) -> None:
    """One part, its headers at `start` and its content up to `end`, added to `form`."""
    head_end = raw.find(_HEAD_END, start, min(end, start + _MAX_HEAD))
    if head_end < 0:
        raise _malformed("a part's headers do not end")
    try:
        head = raw[start:head_end].decode()
    except UnicodeDecodeError:
        raise _malformed("a part's headers are not UTF-8") from None
    disposition = None
    for line in head.split("\r\n"):
        name, colon, value = line.partition(":")
        if colon and name.strip().lower() == "content-disposition":
            if disposition is not None:
                raise _malformed("a part has two Content-Disposition headers")
            disposition = value.strip()
    if disposition is None or media_type(disposition) != "form-data":
        raise _malformed("a part has no Content-Disposition: form-data")
    params = _params(disposition)
    field = params.get("name")
    if not field:
        raise _malformed("a part has no name")
    if field in form:
        form.repeated.add(field)
        return
    content = head_end + len(_HEAD_END)
    if "filename" in params or "filename*" in params:  # RFC 7578, 4.2: a file part
        form[field] = Upload(params.get("filename") or params["filename*"], content, end)
        return
    try:
        form[field] = raw[content:end].decode()
    except UnicodeDecodeError:
        raise _malformed(f"the value of {field!r} is not UTF-8") from None
    form.spans[field] = (content, end)


def decode_form(raw: bytes, content_type: str) -> Form:
    """The fields of a `multipart/form-data` body, or a 4xx: 415 for another media type, 400
    for a body that is not a whole form of at most `MAX_PARTS` parts."""
    delimiter = b"--" + _boundary(content_type)
    first = raw.find(delimiter)
    if first < 0 or (first > 0 and raw[first - 2 : first] != _CRLF):
        raise _malformed("it does not start with its boundary")
    separator = _CRLF + delimiter
    form = Form()
    at = first + len(delimiter)
    for _ in range(MAX_PARTS + 1):
        if raw.startswith(b"--", at):  # the close delimiter: what follows is an epilogue
            return form
        if not raw.startswith(_CRLF, at):
            raise _malformed("a boundary is followed by neither a part nor the end")
        end = raw.find(separator, at)
        if end < 0:
            raise _malformed("a part does not end (a body cut short?)")
        _part(raw, at + len(_CRLF), end, form)
        at = end + len(separator)
    raise _malformed(f"over {MAX_PARTS} parts")


def _text(form: dict[str, Any], name: str) -> str | None:
    value = form.get(name)
    if value is not None and not isinstance(value, str):
        raise BadRequest(f"'{name}' must be a text field, not a file", param=name)
    return value


def _transcript(answer: bytearray) -> str:
    """A whole answer's text: a JSON answer's `text` (`json`, `verbose_json`), else the answer
    itself (`text`, `srt`, `vtt`)."""
    try:
        decoded = orjson.loads(answer)
    except orjson.JSONDecodeError:
        return answer.decode("utf-8", "replace")
    text = decoded.get("text") if isinstance(decoded, dict) else None
    return text if isinstance(text, str) else ""


# The example's audio: a WAV header and a tenth of a second of silence at 16 kHz, mono.
_SILENCE = 1600 * 2
_WAV = (
    b"RIFF" + (36 + _SILENCE).to_bytes(4, "little") + b"WAVEfmt "
    + (16).to_bytes(4, "little") + (1).to_bytes(2, "little") + (1).to_bytes(2, "little")
    + (16000).to_bytes(4, "little") + (32000).to_bytes(4, "little")
    + (2).to_bytes(2, "little") + (16).to_bytes(2, "little")
    + b"data" + _SILENCE.to_bytes(4, "little") + bytes(_SILENCE)
)  # fmt: skip
_EXAMPLE_BOUNDARY = "gateway-example-boundary"


class SpeechToTextApi(OpenAIApi):
    """A speech model's upload, answered with its text (OpenAI's shape; a stream's framing is
    chat's, `data: [DONE]` last)."""

    __slots__ = ()
    prompt_param = "prompt"
    content_type = FORM
    openai_fields = False  # `n`, `stream_options`, ... are not this form's
    exact = False  # the decoder's prompt and the audio's tokens are vLLM's to add

    def decode(self, raw: bytes, content_type: str, limits: ServerSpec) -> dict[str, Any]:
        return decode_form(raw, content_type)

    def parse(self, ctx: Ctx, body: dict[str, Any], limits: ServerSpec) -> tuple[int, int | None]:
        """An audio file and an optional text prompt; no bound on the output (see above)."""
        repeated = [name for name in _READ if name in getattr(body, "repeated", ())]
        if repeated:
            raise BadRequest(f"'{repeated[0]}' is given twice", param=repeated[0])
        if not isinstance(body.get("file"), Upload):
            raise BadRequest("'file' is required: the audio, as a file part", param="file")
        check_prompt_chars(len(_text(body, "prompt") or ""), limits, "prompt")
        # vLLM's stream options, flattened into the form: the usage chunk is the client's then.
        wants_usage = body.get("stream_include_usage")
        ctx.client_wants_usage = lax_bool(wants_usage, "stream_include_usage", False, nullable=True)
        return 1, None

    async def count(
        self, body: dict[str, Any], counter: TokenCounter, refuse_at: int, images: int
    ) -> tuple[int, int]:
        """The text prompt's tokens, when there is one."""
        prompt = body.get("prompt")
        if not prompt:
            return 0, 0
        tokens = sum(await counter.count_prompts(prompt, refuse_at))
        return tokens, tokens

    async def prompt_ids(
        self, body: dict[str, Any], counter: TokenCounter, special: bool | None = None
    ) -> list[int] | None:
        """Unknown: vLLM's prompt is the model's own, around the audio."""
        return None

    def fingerprint(self, body: dict[str, Any]) -> int:
        """The prompt's start and the language: what makes two uploads' answers alike, as far
        as the gateway can tell without hearing them."""
        return hash(((body.get("prompt") or "")[:FINGERPRINT_CHARS], body.get("language")))

    def input_floor(self, ctx: Ctx, counter: TokenCounter) -> int:
        return 0

    def upstream_fields(self, ctx: Ctx, changes: dict[str, Any]) -> None:
        """Nothing: a stream's usage is the client's to ask for (`stream_include_usage`)."""

    async def count_answer(self, ctx: Ctx, answer: bytearray) -> None:
        """The transcript's tokens: what the tenant got (see the module's docstring). A large
        answer (a replica may send up to `max_response_bytes`) is decoded off the event loop;
        a count that fails leaves the request to settle on its reservation, its answer served."""
        assert ctx.pool is not None
        try:
            if len(answer) > INLINE_DECODE_BYTES:
                text = await asyncio.to_thread(_transcript, answer)
            else:
                text = _transcript(answer)
            [ctx.output_tokens] = await ctx.pool.model.counter.count_prompts(text, special=False)
        except Exception:
            log.exception("request %s: the transcript could not be counted", ctx.request_id)
            return
        ctx.output_counted = True

    def read_usage(self, ctx: Ctx, usage: Any) -> None:
        """A stream's usage chunk; a whole answer's output is counted already (`count_answer`),
        and its usage, the audio's seconds, is no count."""
        if not ctx.output_counted:
            super().read_usage(ctx, usage)

    def upstream_body(self, ctx: Ctx, changes: dict[str, Any]) -> bytes:
        """The client's bytes, a rewritten `model` spliced in. vLLM's speech-to-text request has
        no `priority`: the pool's is not sent, and a client's is read by nothing."""
        model = changes.get("model")
        if model is None:
            return ctx.raw
        assert isinstance(ctx.body, Form)
        start, end = ctx.body.spans["model"]
        return b"".join((ctx.raw[:start], model.encode(), ctx.raw[end:]))

    def example(self, model: str) -> tuple[bytes, str]:
        """A tenth of a second of silence, as the `openai` SDK uploads a file."""
        delimiter = f"--{_EXAMPLE_BOUNDARY}\r\n".encode()
        fields = b"".join(
            delimiter + f'Content-Disposition: form-data; name="{name}"\r\n\r\n{value}\r\n'.encode()
            for name, value in (("model", model), ("response_format", "json"))
        )
        upload = (
            delimiter
            + b'Content-Disposition: form-data; name="file"; filename="silence.wav"\r\n'
            + b"Content-Type: audio/wav\r\n\r\n"
            + _WAV
            + b"\r\n"
        )
        end = f"--{_EXAMPLE_BOUNDARY}--\r\n".encode()
        return fields + upload + end, f"{FORM}; boundary={_EXAMPLE_BOUNDARY}"


class TranscriptionsApi(SpeechToTextApi):
    __slots__ = ()
    name = "transcriptions"
    path = "/v1/audio/transcriptions"


TRANSCRIPTIONS = TranscriptionsApi()


class TranslationsApi(SpeechToTextApi):
    __slots__ = ()
    name = "translations"
    path = "/v1/audio/translations"


TRANSLATIONS = TranslationsApi()
