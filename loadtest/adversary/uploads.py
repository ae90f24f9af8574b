"""Speech-to-text uploads as a client writes them: `multipart/form-data` bodies, valid and not.

Built here byte by byte (not by an HTTP library, which would refuse to write the broken ones):
the audio is random bytes (the gateway never looks inside it; the replica does not decode it
either), the nonce rides in the file's name. A hostile body says which refusal it must get:
a form cut short, a part without its `Content-Disposition`, a Content-Type without a boundary
(400 `invalid_multipart`), a field the gateway reads given twice (400), no file (400), another
media type (415), a body over the policy's `server.max_body_bytes` (413).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

FORM = "multipart/form-data"
# The harness's `server.max_body_bytes`: small, so an oversized upload costs little to send.
MAX_BODY_BYTES = 1 << 20
HOSTILE = ("cut", "no_disposition", "no_boundary", "repeated", "no_file", "json_type", "oversized")


@dataclass
class Upload:
    """A body, its Content-Type and the refusal it must get (None: a valid form)."""

    raw: bytes
    content_type: str
    expect: int | None = None


def _part(boundary: str, name: str, value: bytes, filename: str | None = None) -> bytes:
    disposition = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
    head = f"--{boundary}\r\nContent-Disposition: {disposition}\r\n"
    if filename:
        head += "Content-Type: audio/wav\r\n"
    return head.encode() + b"\r\n" + value + b"\r\n"


def form(boundary: str, fields: list[tuple[str, str]], audio: bytes | None, filename: str) -> bytes:
    parts = [_part(boundary, name, value.encode()) for name, value in fields]
    if audio is not None:
        parts.append(_part(boundary, "file", audio, filename))
    return b"".join(parts) + f"--{boundary}--\r\n".encode()


def draw(rng: random.Random, fields: dict[str, str], nonce: str) -> Upload:
    """`fields` (text, in order) and random audio named after `nonce`, valid or (one in five)
    one of `HOSTILE`'s shapes."""
    boundary = f"----adversary{rng.getrandbits(64):016x}"
    audio = rng.randbytes(rng.choice((64, 2_000, 40_000, 200_000)))
    pairs = list(fields.items())
    filename = f"{nonce}.wav"
    content_type = f"{FORM}; boundary={boundary}"
    if rng.random() < 0.15:  # a field the gateway does not read, twice: still a valid form
        pairs.append(("language", rng.choice(("en", "fr"))))
    if rng.random() > 0.2:
        return Upload(form(boundary, pairs, audio, filename), content_type)
    hostile = rng.choice(HOSTILE)
    if hostile == "repeated":
        name = rng.choice([n for n in ("model", "prompt", "stream") if n in fields] or ["model"])
        pairs.insert(rng.randrange(len(pairs) + 1), (name, fields.get(name, "again")))
        return Upload(form(boundary, pairs, audio, filename), content_type, 400)
    if hostile == "no_file":
        raw = form(boundary, [*pairs, ("note", filename)], None, filename)
        return Upload(raw, content_type, 400)
    if hostile == "oversized":
        audio = rng.randbytes(MAX_BODY_BYTES + rng.randint(1, 200_000))
        return Upload(form(boundary, pairs, audio, filename), content_type, 413)
    raw = form(boundary, pairs, audio, filename)
    if hostile == "cut":  # the close delimiter and the end of the file part gone
        return Upload(raw[: raw.rindex(b"\r\n--")], content_type, 400)
    if hostile == "no_disposition":
        raw = raw.replace(b"Content-Disposition: form-data; ", b"X-Part: ", 1)
        return Upload(raw, content_type, 400)
    if hostile == "no_boundary":
        return Upload(raw, FORM, 400)
    return Upload(raw, "application/json", 415)
