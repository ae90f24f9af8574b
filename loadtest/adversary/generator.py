"""Seeded random traffic: what each request is, what the replica does with it, how its client
behaves. Everything comes from one `random.Random(seed)`, drawn in a fixed order before any
request is sent, so a seed replays the same plan (the timing of the processes may still differ).

A plan is a list of moves, each a group of requests with a start time. Most moves are single
requests of random shape on a random endpoint (every endpoint the gateway registers:
`endpoints.py`); some are the sequences that broke promises before: train an estimate with
`max_tokens: 1` under one system prompt, then a concurrent burst of long bounds; a burst with no
bound at all; Responses chains; streams of thousands of tiny usage-bearing events; streams of many
tokens per event that the client leaves early; a burst of uploads with long transcripts, some
left mid-upload.
"""

from __future__ import annotations

import random
import uuid
from dataclasses import dataclass, field
from typing import Any

from loadtest.adversary import uploads
from loadtest.adversary.endpoints import DRAWN, GENERATIVE, SPEECH
from loadtest.adversary.replica import Script

WORDS = (
    "river stone lamp quiet orbit maple signal copper garden winter ladder velvet harbor"
    " thunder pencil meadow circuit lantern canyon breeze marble fossil ember prism"
    " 北京 café naïve 🙂 ünïcödé ∑ 1234 -- <tag> {json} \\n"
).split()

ENDPOINT_PATHS = {name: drawn.path for name, drawn in DRAWN.items()}


@dataclass
class Planned:
    """One request: what is sent, to which gateway, and how its client reads the answer."""

    nonce: str
    tenant: str
    gateway: int
    endpoint: str
    model: str
    body: dict[str, Any]  # an upload's: its text fields
    script: Script
    # all | leave (at `leave_byte` of the answer) | slow | leave_upload (at `leave_byte` of the
    # body, an upload's)
    read: str = "all"
    leave_byte: int = 0
    after: str | None = None  # a Responses chain: the nonce whose answer's id it continues
    move: str = "single"
    upload: uploads.Upload | None = None  # a multipart body, sent as it is (not `body`)
    # Request headers as sent, in order, a name possibly twice: latency objectives (ours and
    # llm-d's names, valid or hostile), `x-priority`, the header a class with `slo` matches.
    headers: list[tuple[str, str]] = field(default_factory=list)

    @property
    def stream(self) -> bool:
        return self.body.get("stream") in (True, "true")


@dataclass
class Move:
    at_s: float
    kind: str
    requests: list[Planned]
    concurrent: bool = False  # all at once, else one after another
    burst_from: int | None = None  # one after another up to this request, the rest at once


@dataclass
class Plan:
    seed: int
    moves: list[Move] = field(default_factory=list)


class Generator:
    """`longest_output` is the largest output bound (`max_tokens` and its kin) a shape draws: a
    sample sent to real vLLM keeps its outputs short, where the scripted replica's cost nothing."""

    def __init__(
        self,
        seed: int,
        models: list[str],
        tenants: list[str],
        gateways: int,
        rich: bool = True,
        longest_output: int = 3000,
        slo_models: tuple[str, ...] = (),
    ) -> None:
        self.rng = random.Random(seed)
        self.seed = seed
        self.models, self.tenants, self.gateways = models, tenants, gateways
        self.longest_output = longest_output
        self.slo_models = slo_models  # served by pools with `slo`: what `slo_burst` attacks

    def nonce(self) -> str:
        return f"adv-{self.rng.getrandbits(48):012x}"

    def text(self, low: int, high: int) -> str:
        return " ".join(self.rng.choice(WORDS) for _ in range(self.rng.randint(low, high)))

    def plan(self, seconds: float) -> Plan:
        plan = Plan(self.seed)
        at = 0.0
        kinds = ["single"] * 10 + [
            "train_burst",
            "unbounded_burst",
            "chain",
            "chain",
            "tiny_events",
            "cut_streams",
            "cut_streams",
            "retry_reset",
            "uploads",
            *(["slo_burst"] * 2 if self.slo_models else []),
        ]
        while at < seconds:
            plan.moves.append(self.move(self.rng.choice(kinds), at))
            at += self.rng.expovariate(1 / 0.35)
        return plan

    def move(self, kind: str, at: float = 0.0) -> Move:
        """One move of `kind` (`single`, `chain`, `train_burst`, ...), as a plan draws it."""
        move: Move = getattr(self, f"_{kind}")(at)
        return move

    # --- the scripts ----------------------------------------------------------------------------

    def script(self, natural: tuple[int, int] = (1, 400)) -> Script:
        r = self.rng
        return Script(
            natural=r.randint(*natural),
            tokens_per_event=1 if r.random() < 0.6 else r.randint(2, 12),
            usage=r.choices(
                ("truth", "missing", "negative", "huge", "understate"), (6, 1, 1, 1, 1)
            )[0],
            transport=r.choices(
                ("ok", "redirect", "hang", "reset_head", "reset_body", "error"), (86, 3, 2, 3, 4, 2)
            )[0],
            pace_s=r.choice((0.0, 0.0, 0.001, 0.003)),
            huge_event_bytes=r.choice((0,) * 19 + (1_000_000,)),
            first_delay_s=r.choices((0.0, 0.3, 1.2, 3.5), (88, 6, 4, 2))[0],
            tokenless=r.random() < 0.04,
        )

    # --- request bodies -------------------------------------------------------------------------

    def request(
        self,
        endpoint: str | None = None,
        tenant: str | None = None,
        model: str | None = None,
        script: Script | None = None,
        move: str = "single",
    ) -> Planned:
        r = self.rng
        endpoint = endpoint or r.choices(list(DRAWN), [d.weight for d in DRAWN.values()])[0]
        model = model or r.choice(self.models)
        nonce = self.nonce()
        body = getattr(self, f"_{endpoint}_body")(model, nonce)
        upload = uploads.draw(r, body, nonce) if endpoint in SPEECH else None
        reads = ("all", "leave", "slow", "leave_upload")
        read = r.choices(reads, (7, 2, 1, 2 if upload is not None else 0))[0]
        headers = self.slo_headers() if r.random() < 0.35 else []
        return Planned(
            nonce=nonce,
            tenant=tenant or r.choice(self.tenants),
            gateway=r.randrange(self.gateways),
            endpoint=endpoint,
            model=model,
            body=body,
            script=script or self.script(),
            read=read,
            leave_byte=r.randint(1, 60_000),
            move=move,
            upload=upload,
            headers=headers,
        )

    def slo_headers(self) -> list[tuple[str, str]]:
        """Latency objectives as a client may send them: valid, tight, loose or hostile, under
        our names or llm-d's or both, a name repeated; with a priority, and now and then the
        header of the class whose objective is tight."""
        r = self.rng
        out: list[tuple[str, str]] = []
        for objective in r.sample((0, 1), r.randint(1, 2)):
            names = r.choice(((SLO_OURS[objective],), (SLO_LLMD[objective],),
                              (SLO_OURS[objective], SLO_LLMD[objective]),
                              (SLO_LLMD[objective], SLO_OURS[objective]),
                              (SLO_OURS[objective], SLO_OURS[objective])))  # fmt: skip
            out += [(name, self.slo_value()) for name in names]
        if r.random() < 0.6:
            out.append(("x-priority", r.choice(("critical", "standard", "sheddable", "sheddable"))))
        if r.random() < 0.15:
            out.append((TIGHT_CLASS_HEADER, "tight"))
        r.shuffle(out)
        return out

    def slo_value(self) -> str:
        r = self.rng
        kind = r.choices(("valid", "tight", "loose", "hostile"), (4, 2, 1, 3))[0]
        if kind == "valid":
            return str(r.choice((r.randint(20, 3000), round(r.uniform(1, 500), 3))))
        if kind == "tight":
            return r.choice(("1", "0.5", "1e-320", "3"))
        if kind == "loose":
            return r.choice(("3600000", "3.6e6", "600000"))
        huge = ("9" * r.randint(400, 9000), "1" + "0" * r.randint(310, 900))  # past a double
        return r.choice((*HOSTILE_MS, *huge))

    def _bound(self, body: dict[str, Any], name: str, required: bool = False) -> None:
        r = self.rng
        if required or r.random() < 0.6:
            body[name] = r.choice((1, r.randint(1, 64), r.randint(64, self.longest_output)))
        if r.random() < 0.15:
            body["ignore_eos"] = True
        if r.random() < 0.1:
            body["min_tokens"] = r.randint(0, 32)

    def _stream(self, body: dict[str, Any], usage_option: bool = True) -> None:
        if self.rng.random() < 0.55:
            body["stream"] = True
            if usage_option and self.rng.random() < 0.5:
                usage = self.rng.random() < 0.7
                body["stream_options"] = {"include_usage": usage}
                if usage and self.rng.random() < 0.3:  # the running count on every chunk too
                    body["stream_options"]["continuous_usage_stats"] = True

    def _content(self, nonce: str) -> Any:
        text = f"{nonce} {self.text(3, 300)}"
        if self.rng.random() < 0.3:
            cut = self.rng.randint(0, len(text))
            return [{"type": "text", "text": text[:cut]}, {"type": "text", "text": text[cut:]}]
        return text

    def _tools(self) -> list[dict[str, Any]] | None:
        if self.rng.random() > 0.2:
            return None
        return [
            {
                "type": "function",
                "function": {
                    "name": f"tool_{i}",
                    "description": self.text(1, 12),
                    "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
                },
            }
            for i in range(self.rng.randint(1, 3))
        ]

    def _chat_body(self, model: str, nonce: str, system: str | None = None) -> dict[str, Any]:
        r = self.rng
        messages: list[dict[str, Any]] = []
        if system is not None or r.random() < 0.5:
            messages.append({"role": "system", "content": system or self.text(2, 40)})
        for _ in range(r.choice((0, 0, 1))):
            messages += [
                {"role": "user", "content": self.text(1, 30)},
                {"role": "assistant", "content": self.text(1, 30)},
            ]
        messages.append({"role": "user", "content": self._content(nonce)})
        body: dict[str, Any] = {"model": model, "messages": messages}
        if (tools := self._tools()) is not None:
            body["tools"] = tools
        if r.random() < 0.15:
            body["n"] = 2
        self._bound(body, r.choice(("max_tokens", "max_completion_tokens")))
        self._stream(body)
        return body

    def _completions_body(self, model: str, nonce: str) -> dict[str, Any]:
        r = self.rng
        body: dict[str, Any] = {"model": model, "prompt": f"{nonce} {self.text(3, 300)}"}
        if r.random() < 0.25:
            # Token ids, below every served vocabulary's size; the nonce rides in `user`, which
            # the replica scans the body for like any other field.
            body["prompt"] = [r.randrange(3, 1900) for _ in range(r.randint(1, 300))]
            body["user"] = nonce
        if r.random() < 0.15:
            body["n"] = 2
        self._bound(body, "max_tokens")
        self._stream(body)
        return body

    def _messages_body(self, model: str, nonce: str, system: str | None = None) -> dict[str, Any]:
        r = self.rng
        messages: list[dict[str, Any]] = []
        for _ in range(r.choice((0, 0, 1, 2))):
            messages += [
                {"role": "user", "content": self.text(1, 30)},
                {"role": "assistant", "content": self.text(1, 30)},
            ]
        messages.append({"role": "user", "content": self._content(nonce)})
        body: dict[str, Any] = {"model": model, "messages": messages}
        if system is not None or r.random() < 0.5:
            system = system or self.text(2, 40)
            body["system"] = system if r.random() < 0.6 else [{"type": "text", "text": system}]
        self._bound(body, "max_tokens", required=True)
        self._stream(body, usage_option=False)
        return body

    def _responses_body(self, model: str, nonce: str, system: str | None = None) -> dict[str, Any]:
        r = self.rng
        given: Any = f"{nonce} {self.text(3, 200)}"
        if r.random() < 0.3:
            given = [{"role": "user", "content": [{"type": "input_text", "text": given}]}]
        body: dict[str, Any] = {"model": model, "input": given}
        if system is not None or r.random() < 0.4:
            body["instructions"] = system or self.text(2, 40)
        self._bound(body, "max_output_tokens")
        self._stream(body, usage_option=False)
        return body

    def _embeddings_body(self, model: str, nonce: str) -> dict[str, Any]:
        given: Any = f"{nonce} {self.text(1, 100)}"
        if self.rng.random() < 0.3:
            given = [given, *(self.text(1, 40) for _ in range(self.rng.randint(1, 4)))]
        return {"model": model, "input": given}

    _classify_body = _pooling_body = _embeddings_body

    def _rerank_body(self, model: str, nonce: str) -> dict[str, Any]:
        docs = [self.text(1, 30) for _ in range(self.rng.randint(1, 8))]
        return {"model": model, "query": f"{nonce} {self.text(1, 10)}", "documents": docs}

    def _score_body(self, model: str, nonce: str) -> dict[str, Any]:
        """Any of vLLM's four pairs of names; one first text for all, or one per second text."""
        r = self.rng
        one, two = r.choice(SCORE_FIELDS)
        second = [self.text(1, 30) for _ in range(r.randint(1, 6))]
        first: Any = f"{nonce} {self.text(1, 10)}"
        if r.random() < 0.3:
            first = [first, *(self.text(1, 10) for _ in second[1:])]
        return {"model": model, one: first, two: second if len(second) > 1 else second[0]}

    def _transcriptions_body(self, model: str, nonce: str) -> dict[str, Any]:
        """An upload's text fields (`uploads.draw` adds the audio): with or without a prompt,
        streamed or not, its usage asked for or not."""
        r = self.rng
        fields = {"model": model}
        if r.random() < 0.6:
            fields["prompt"] = self.text(1, 60)
        fields["response_format"] = "json"
        if r.random() < 0.5:
            fields["stream"] = "true"
            if r.random() < 0.5:
                fields["stream_include_usage"] = r.choice(("true", "false"))
        elif r.random() < 0.2:
            fields["stream"] = "false"
        return fields

    _translations_body = _transcriptions_body

    def _tokenize_body(self, model: str, nonce: str) -> dict[str, Any]:
        return {"model": model, "prompt": f"{nonce} {self.text(1, 100)}"}

    def _detokenize_body(self, model: str, nonce: str) -> dict[str, Any]:
        """Token ids to decode: a few, many, or some no vocabulary holds (a 400)."""
        r = self.rng
        top = r.choice((1000, 1000, 1000, 10**9))
        return {
            "model": model,
            "tokens": [r.randrange(top) for _ in range(r.choice((1, 50, 4000)))],
        }

    def _count_tokens_body(self, model: str, nonce: str) -> dict[str, Any]:
        """A Messages body to count (Anthropic's `count_tokens`): no bound, no stream."""
        body = self._messages_body(model, nonce)
        body.pop("max_tokens", None)
        body.pop("stream", None)
        return body

    def _passthrough_body(self, model: str, nonce: str) -> dict[str, Any]:
        return {"model": model, "note": nonce}

    # --- moves ----------------------------------------------------------------------------------

    def _single(self, at: float) -> Move:
        return Move(at, "single", [self.request()])

    def _train_burst(self, at: float) -> Move:
        """Teach the estimate short answers under one system prompt, then ask for long ones."""
        r = self.rng
        tenant, model = r.choice(self.tenants), r.choice(self.models)
        endpoint = r.choice(("chat", "messages", "responses"))
        system = self.text(20, 60)
        name = {"chat": "max_tokens", "messages": "max_tokens", "responses": "max_output_tokens"}
        out = []
        trained = r.randint(8, 20)
        for i in range(trained + r.randint(8, 20)):
            training = i < trained
            nonce = self.nonce()
            body = getattr(self, f"_{endpoint}_body")(model, nonce, system)
            body.pop("n", None)
            body[name[endpoint]] = 1 if training else r.randint(1500, 3000)
            body.pop("stream", None)
            body.pop("stream_options", None)
            script = Script(natural=r.randint(1500, 3000), usage="truth")
            out.append(
                Planned(
                    nonce,
                    tenant,
                    r.randrange(self.gateways),
                    endpoint,
                    model,
                    body,
                    script,
                    move="train_burst",
                )
            )
        return Move(at, "train_burst", out, burst_from=trained)

    def _unbounded_burst(self, at: float) -> Move:
        """No output bound: vLLM generates to the end of the context (or its end-of-sequence)."""
        r = self.rng
        tenant, model = r.choice(self.tenants), r.choice(self.models)
        endpoint = r.choice(("chat", "responses"))
        out = []
        for _ in range(r.randint(6, 16)):
            p = self.request(
                endpoint, tenant, model, Script(natural=r.randint(2000, 6000)), "unbounded_burst"
            )
            for key in ("max_tokens", "max_completion_tokens", "max_output_tokens", "n"):
                p.body.pop(key, None)
            p.read = "all"
            out.append(p)
        return Move(at, "unbounded_burst", out, concurrent=True)

    def _chain(self, at: float) -> Move:
        r = self.rng
        tenant, model = r.choice(self.tenants), r.choice(self.models)
        out: list[Planned] = []
        for turn in range(r.randint(2, 4)):
            p = self.request("responses", tenant, model, Script(natural=r.randint(5, 60)), "chain")
            p.script.transport, p.read = "ok", "all"
            if turn:
                p.after = out[-1].nonce
                p.gateway = r.randrange(self.gateways)
            out.append(p)
        return Move(at, "chain", out)

    def _tiny_events(self, at: float) -> Move:
        p = self.request(self.rng.choice(GENERATIVE), script=self.script(), move="tiny_events")
        p.body["stream"] = True
        p.script.tiny_events = self.rng.choice((12_000, 48_000, 96_000))
        p.script.transport = "ok"
        return Move(at, "tiny_events", [p])

    def _cut_streams(self, at: float) -> Move:
        """Streams of many tokens per event, each read a while then left, one after another by
        one tenant: charged for what it was delivered, or per event?"""
        r = self.rng
        tenant, model = r.choice(self.tenants), r.choice(self.models)
        out = []
        for _ in range(r.randint(4, 12)):
            endpoint = r.choice(GENERATIVE)
            script = Script(natural=3000, tokens_per_event=r.randint(4, 12), pace_s=0.002)
            p = self.request(endpoint, tenant, model, script, "cut_streams")
            p.body.pop("n", None)
            p.body["stream"] = True
            key = {"responses": "max_output_tokens"}.get(endpoint, "max_tokens")
            p.body.pop("max_completion_tokens", None)
            p.body[key] = 3000
            p.body["ignore_eos"] = True
            if endpoint in ("chat", "completions"):
                p.body["stream_options"] = {"include_usage": True}
            p.read, p.leave_byte = "leave", r.randint(20_000, 400_000)
            out.append(p)
        return Move(at, "cut_streams", out)

    def _uploads(self, at: float) -> Move:
        """Uploads by one tenant one after another with long transcripts, answered whole (whose
        usage is the audio's seconds, no token count) or streamed with their usage: is what the
        tenant got charged? Some clients leave mid-upload or mid-answer. Not at once: no bound
        limits a transcript, so uploads admitted together on their reservations may together
        produce past the window before any is charged (docs/api.md), which Q does not allow."""
        r = self.rng
        tenant, model = r.choice(self.tenants), r.choice(self.models)
        out = []
        for _ in range(r.randint(4, 10)):
            script = Script(natural=r.randint(1500, 3000), usage="truth")
            p = self.request(r.choice(SPEECH), tenant, model, script, "uploads")
            p.body.pop("stream", None)
            p.body.pop("stream_include_usage", None)
            if r.random() < 0.5:  # streamed, its usage asked for: believed past the reservation?
                p.body["stream"], p.body["stream_include_usage"] = "true", "true"
            p.upload = uploads.draw(r, p.body, p.nonce)
            out.append(p)
        return Move(at, "uploads", out)

    def _slo_burst(self, at: float) -> Move:
        """More streams at once than a pool with `slo` has slots, by every tenant and tier, with
        objectives tight, loose and hostile: the queue orders each flow by deadline, sheddable
        work no replica would serve in time is refused, the latency model counts every flight
        in and out. The replica lies to the model: first tokens late (some past the gateway's
        `first_token_s`), streams with none, answers whole (no first token to see)."""
        r = self.rng
        model = r.choice(self.slo_models)
        out = []
        for _ in range(r.randint(14, 26)):
            script = Script(
                natural=r.randint(2, 40),
                pace_s=r.choice((0.0, 0.002, 0.01)),
                first_delay_s=r.choices((0.0, 0.1, 0.5, 1.5, 3.5), (5, 3, 2, 1, 1))[0],
                tokenless=r.random() < 0.1,
                transport=r.choices(("ok", "reset_head", "error"), (12, 1, 1))[0],
            )
            p = self.request(r.choice(GENERATIVE), model=model, script=script, move="slo_burst")
            for key in ("n", "ignore_eos", "min_tokens", "max_completion_tokens"):
                p.body.pop(key, None)
            # Short answers, reserved as such: a burst on the queue, not on the tenants' windows.
            p.body[_BOUND_NAMES[p.endpoint]] = r.randint(4, 64)
            if r.random() < 0.8:
                p.body["stream"] = True
            p.headers = self.slo_headers()
            p.read = r.choices(("all", "leave"), (5, 1))[0]
            out.append(p)
        return Move(at, "slo_burst", out, concurrent=True)

    def _retry_reset(self, at: float) -> Move:
        p = self.request(self.rng.choice(GENERATIVE), move="retry_reset")
        p.script.transport = "reset_head"
        return Move(at, "retry_reset", [p])


# The latency-objective headers, ours and llm-d's, by objective (TTFT, TPOT), and values no
# objective may take (gateway/request/objective.py: milliseconds over 0, at most an hour).
SLO_OURS = ("x-slo-ttft-ms", "x-slo-tpot-ms")
SLO_LLMD = ("x-llm-d-slo-ttft-ms", "x-llm-d-slo-tpot-ms")
HOSTILE_MS = (
    "nan", "NaN", "inf", "-inf", "Infinity", "-0", "0", "0.0", "-5", "1e309", "3600001", "abc",
    "", "0x10", "5ms", "1,5",
)  # fmt: skip
TIGHT_CLASS_HEADER = "x-adversary-class"


# The output bound each generative endpoint reads.
_BOUND_NAMES = {
    "chat": "max_tokens", "completions": "max_tokens", "messages": "max_tokens",
    "responses": "max_output_tokens",
}  # fmt: skip

# vLLM's names of a score request's two sides (gateway/api/scoring.py admits the same).
SCORE_FIELDS = (
    ("text_1", "text_2"), ("queries", "documents"), ("queries", "items"), ("data_1", "data_2")
)  # fmt: skip


def fresh_seed() -> int:
    return uuid.uuid4().int % 1_000_000_000


def reserved_slots(seed: int) -> int:
    """Slots each replica keeps for the `tight` class with shared state: 4 or 2 of 12, or none.
    A reservation makes a gateway's idle spare leases of one class refuse another class's
    request, which must give them back and ask again. Drawn apart from the plan too."""
    return random.Random(f"reserve:{seed}").choice((4, 2, 0))


def slow_replies(seed: int) -> float:
    """How long each of Redis's replies is held in the run's slow spell with shared state: none,
    a quarter of the gateways' call time-out (which calls still outlast), or more than it. Drawn
    apart from the plan too."""
    return random.Random(f"slow:{seed}").choice((0.0, 0.05, 0.5))


def shared_state(seed: int) -> dict[str, Any]:
    """How a run's gateways share state: quota slices and spare slot leases off, at their
    defaults, or larger. Drawn apart from the plan, so a seed's requests are the same whatever
    it draws here."""
    rng = random.Random(f"state:{seed}")
    return {
        "slices": {"fraction": rng.choice((0.0, 0.05, 0.2)), "max_age_s": rng.choice((0.5, 2.0))},
        "spare_slots_s": rng.choice((0.0, 0.1, 0.5)),
    }
