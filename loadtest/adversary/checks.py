"""The four promises, checked on a finished `Run` (docs/architecture.md, "What the gateway
promises"), and the refusals the generator drew requests for (R). Each broken promise is one
`Broken`: its letter, what was seen against what was promised, and the requests that did it
(nonces, findable in the replay)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from gateway.config.schema import PRIORITIES
from gateway.state.failover import RETRY_S
from loadtest.adversary.endpoints import COUNTED, COUNTING, SPEECH
from loadtest.adversary.generator import SLO_LLMD, SLO_OURS, Planned
from loadtest.adversary.harness import (
    LAG_S,
    MAX_MODEL_LEN,
    OUTPUT_CAPS,
    REDIS_TIMEOUT_S,
    SLO,
    TENANTS,
    TIERS,
    Outcome,
    Run,
)

WINDOW_S = 60.0
# L: a second in which /healthz answered more than LAG_S later than its quiet baseline's
# worst, once the time the machine explains is taken off (`ticker`: the longest a gateway
# thread, or the ticker, waited ready for a core). On two cores shared with other work the raw
# latency misleads: a busy machine made it 310 ms late once with the gateway's loop idle, where
# the scheduler's own count showed the loop ready and waiting. The gateway's loop-lag histogram
# (a sample every 250 ms) is named in the failure when it saw the same, as a second witness.
# Issue 35's relay, KV-event and (first) tokenizer holds were 203-567 ms.
GAUGES_AT_ZERO = (
    "llm_inflight_requests",
    "llm_inflight_tokens",
    "llm_queue_depth",
    "llm_replica_leases",
    # The latency model's flights (a pool with `slo`): a Flight not released is a leak.
    "llm_replica_prefill_tokens",
    "llm_replica_decoding",
)


@dataclass
class Broken:
    promise: str  # Q, C, L, S (X: a leak through a followed redirect; R: a refusal)
    what: str
    nonces: list[str] = field(default_factory=list)

    def line(self, seed: int) -> str:
        shown = ", ".join(self.nonces[:12]) + (" ..." if len(self.nonces) > 12 else "")
        return f"[{self.promise}] seed {seed}: {self.what}" + (
            f" (requests: {shown})" if shown else ""
        )


def _log_by_nonce(run: Run) -> dict[str, list[dict[str, Any]]]:
    """Access-log lines by the nonce the harness sent as `x-request-id`; a gateway that logs an id
    of its own is matched through the id the replica received."""
    upstream = {a.upstream_id: n for n, arrivals in run.ledger.arrivals.items() for a in arrivals}
    out: dict[str, list[dict[str, Any]]] = defaultdict(list)
    scripted = run.ledger.scripts
    for line in run.access:
        rid = str(line.get("request_id"))
        nonce = rid if rid in scripted else upstream.get(rid)
        if nonce is not None:
            out[nonce].append(line)
    return out


def tokens_got(outcome: Outcome, run: Run) -> int:
    """What a request's tenant got: the prompt the replica prefilled, and the output it produced,
    counted from the client's own reading when the client left a stream early (what it got), and
    at the replica's word where its usage was a plausible understatement (a lie no gateway can
    see, bounded by the reservation)."""
    arrivals = run.ledger.arrivals.get(outcome.planned.nonce, [])
    if not arrivals:
        return 0
    prompt = max(a.prompt_tokens or 0 for a in arrivals)
    produced = sum(a.produced for a in arrivals)
    if outcome.left_early and outcome.planned.stream:
        produced = min(produced, outcome.received_tokens)
    elif outcome.left_early:
        produced = 0
    if outcome.planned.script.usage == "understate" and any(a.finished for a in arrivals):
        produced = min(produced, sum(a.reported or 0 for a in arrivals))
    return prompt + produced


def _undercharged(run: Run, nonces: list[str]) -> str:
    """Which moves got more than the gateway reserved for them when it admitted them or charged
    them when it settled (the smaller of the two, from its access log), summed by move: names
    the trick. A request that got more than it reserved let others in on room it then used; one
    that got more than it was charged left room behind for the next."""
    logged = _log_by_nonce(run)
    outcomes = {o.planned.nonce: o for o in run.outcomes}
    by_move: dict[str, int] = defaultdict(int)
    for nonce in nonces:
        lines = logged.get(nonce, [])
        inputs = sum(x.get("input_tokens") or 0 for x in lines)
        charged = inputs + sum(x.get("output_tokens") or 0 for x in lines)
        reserved = inputs + sum(x.get("expected_output_tokens") or 0 for x in lines)
        outcome = outcomes[nonce]
        by_move[f"{outcome.planned.move}/{outcome.planned.endpoint}"] += max(
            0, tokens_got(outcome, run) - min(charged, reserved)
        )
    worst = sorted(by_move.items(), key=lambda kv: -kv[1])[:4]
    return "; got beyond their reservation or charge: " + ", ".join(
        f"{k} {v:+d}" for k, v in worst if v
    )


def check_quota(run: Run) -> list[Broken]:
    broken = []
    by_tenant: dict[str, list[tuple[float, int, str]]] = defaultdict(list)
    for outcome in run.outcomes:
        if outcome.planned.endpoint in COUNTING:  # no replica: nothing the ledger can weigh
            continue
        got = tokens_got(outcome, run)
        reached = bool(run.ledger.arrivals.get(outcome.planned.nonce))
        if reached or got:
            by_tenant[outcome.planned.tenant].append((outcome.sent_at, got, outcome.planned.nonce))
    for tenant, rows in by_tenant.items():
        tpm, rpm = TENANTS[tenant]
        rows.sort()
        for i, (start, _, _) in enumerate(rows):
            window = [r for r in rows[i:] if r[0] < start + WINDOW_S]
            tokens = sum(r[1] for r in window)
            burst = max(r[1] for r in window)  # about one request's worth: the largest one's
            outages = _outages(run, start)
            bound = tpm * (1 + outages) + burst
            if tokens > bound:
                worst = sorted(window, key=lambda r: -r[1])
                crossed = _crossing(window, tpm * (1 + outages)) - run.started
                broken.append(
                    Broken(
                        "Q",
                        f"tenant {tenant} got {tokens} tokens in the 60 s from"
                        f" +{start - run.started:.1f}s, over its {tpm} TPM + burst {burst}"
                        f"{f' (TPM x{1 + outages}: Redis away or late)' if outages else ''}"
                        f" ({tokens / tpm:.1f}x its TPM; over from the request sent at"
                        f" +{crossed:.1f}s)" + _undercharged(run, [r[2] for r in window]),
                        [r[2] for r in worst],
                    )
                )
                break
        for i, (start, _, _) in enumerate(rows):
            window = [r for r in rows[i:] if r[0] < start + WINDOW_S]
            if len(window) > rpm * (1 + _outages(run, start)):
                broken.append(
                    Broken(
                        "Q",
                        f"tenant {tenant} sent {len(window)} requests that"
                        f" reached a replica in 60 s, over its {rpm} RPM",
                        [r[2] for r in window],
                    )
                )
                break
    return broken


def _crossing(window: list[tuple[float, int, str]], limit: int) -> float:
    """When the window first went over: the send time of the request that took it there."""
    total, largest = 0, 0
    for sent, got, _ in window:
        total, largest = total + got, max(largest, got)
        if total > limit + largest:
            return sent
    return window[-1][0]


def _outages(run: Run, start: float) -> int:
    """Windows that see Redis go away and come back may hold up to two more `tpm` (`rpm`): one
    counted locally while Redis is away (`on_failure: open`, each gateway at 1/gateways of the
    limit, so all of them at one limit), one after Redis comes back empty (no persistence); a
    window that sees Redis answer late, one more.
    Away as the gateways see it: each tries Redis again only `RETRY_S` after its last failure
    (a call that failed as Redis came back may have taken its whole time-out to fail), so it
    may count locally that long after Redis is back."""
    more = 0
    if run.redis_down is not None:
        down, up = run.redis_down
        if start <= up + REDIS_TIMEOUT_S + RETRY_S and down <= start + WINDOW_S:
            more += 2
    if run.redis_slow is not None:
        # Replies held, even for a quarter of the call time-out (calls still outlast it: a wait
        # for a connection and a new one's set-up add up), send the gateways to count locally
        # as while Redis is away, but Redis keeps what it did: one more limit, not two.
        began, ended, held_s = run.redis_slow
        if start <= ended + held_s + REDIS_TIMEOUT_S + RETRY_S and began <= start + WINDOW_S:
            more += 1
    return more


def check_counts(run: Run) -> list[Broken]:
    wrong: list[str] = []
    examples: list[str] = []
    for nonce, lines in _log_by_nonce(run).items():
        arrivals = run.ledger.arrivals.get(nonce, [])
        counted = [a.prompt_tokens for a in arrivals if a.prompt_tokens is not None]
        for line in lines:
            if line.get("endpoint") not in COUNTED or not counted or line.get("status") != 200:
                continue
            if line.get("input_tokens") != counted[-1]:
                wrong.append(nonce)
                if len(examples) < 4:
                    examples.append(
                        f"{line.get('endpoint')} {line.get('model')}: gateway"
                        f" {line.get('input_tokens')}, replica {counted[-1]}"
                    )
    if not wrong:
        return []
    return [
        Broken(
            "C",
            f"{len(wrong)} admitted requests counted unlike vLLM (" + "; ".join(examples) + ")",
            wrong,
        )
    ]


def worst_loop(run: Run) -> list[tuple[float, float]]:
    """Per gateway, its quiet baseline and its worst unexplained second under attack: how near
    the margin a run that held came."""
    start, end = run.attack
    return [
        (
            max((u for t, _, u in ticks if t < run.started - 1), default=0.0),
            max((u for t, _, u in ticks if start <= t <= end + 1), default=0.0),
        )
        for ticks in run.ticks
    ]


def check_loop(run: Run) -> list[Broken]:
    broken = []
    start, end = run.attack
    for i, ticks in enumerate(run.ticks):
        quiet = [u for t, _, u in ticks if t < run.started - 1]
        loud = [(t, w, u) for t, w, u in ticks if start <= t <= end + 1]
        if not quiet or not loud:
            broken.append(Broken("L", f"gateway {i}: the ticker reported nothing"))
            continue
        baseline = max(quiet)
        late = sorted((t, w, u) for t, w, u in loud if u > baseline + LAG_S)
        if not late:
            continue
        held = [t for t, _ in run.lags[i]]
        seconds = []
        culprits: set[str] = set()
        for when, worst, unexplained in late[:8]:
            running = [o for o in run.outcomes if o.sent_at <= when + 1 and o.ended >= when]
            culprits.update(o.planned.nonce for o in running)
            kinds = sorted({f"{o.planned.move}/{o.planned.endpoint}" for o in running})
            seen = any(when - 1.5 <= h <= when + 2.5 for h in held)
            seconds.append(
                f"{unexplained * 1000:.0f} ms ({worst * 1000:.0f} ms in all) at"
                f" +{when - run.started:.0f}s{', its loop-lag histogram too' if seen else ''}"
                f" (running: {', '.join(kinds) or 'nothing'})"
            )
        broken.append(
            Broken(
                "L",
                f"gateway {i}: /healthz over its quiet baseline {baseline * 1000:.0f} ms +"
                f" {LAG_S * 1000:.0f} ms beyond what the machine explains, in {len(late)} s:"
                f" {'; '.join(seconds)}",
                sorted(culprits),
            )
        )
    return broken


def check_slots(run: Run) -> list[Broken]:
    broken = []
    for i, text in enumerate(run.metrics):
        for family in text_string_to_metric_families(text):
            if family.name in GAUGES_AT_ZERO:
                left = sum(s.value for s in family.samples)
                if left:
                    broken.append(
                        Broken(
                            "S",
                            f"gateway {i}: {family.name} is {left:g} after the"
                            " drain and a quiet period",
                        )
                    )
    if run.ledger.open_requests:
        broken.append(Broken("S", f"the replicas still hold {run.ledger.open_requests} requests"))
    if run.redis_leases:
        broken.append(Broken("S", f"Redis still holds {run.redis_leases} live slot leases"))
    for i, reports in enumerate(run.asyncio_reports):
        if reports:
            broken.append(
                Broken(
                    "S",
                    f"gateway {i}: asyncio reported {len(reports)} resources lost, first:"
                    f" {reports[0].split(' ERROR asyncio: ', 1)[1][:200]}",
                )
            )
    twice = [n for n, lines in _log_by_nonce(run).items() if len(lines) > 1]
    if twice:
        broken.append(Broken("S", f"{len(twice)} requests logged (charged) more than once", twice))
    overcharged = []
    for nonce, lines in _log_by_nonce(run).items():
        arrivals = run.ledger.arrivals.get(nonce, [])
        outcome_ok = lines[0].get("status") == 200 and lines[0].get("output_tokens") is not None
        if (
            outcome_ok
            and run.ledger.scripts[nonce].usage == "truth"
            and arrivals
            and all(a.finished for a in arrivals[-1:])
        ):
            produced = arrivals[-1].produced
            if lines[0]["output_tokens"] > produced and produced <= MAX_MODEL_LEN:
                overcharged.append(nonce)
    if overcharged:
        broken.append(
            Broken(
                "S",
                f"{len(overcharged)} requests charged more output than the"
                " replica truthfully reported",
                overcharged,
            )
        )
    return broken


def check_leaks(run: Run) -> list[Broken]:
    leaked = [o.planned.nonce for o in run.outcomes if o.leaked]
    if not leaked:
        return []
    return [
        Broken(
            "X",
            "a replica's redirect was followed: a local service's answer reached the tenant",
            leaked,
        )
    ]


# The output bound a request asks for, by the field the gateway reads first.
_BOUNDS = {
    "chat": ("max_completion_tokens", "max_tokens"),
    "completions": ("max_tokens",),
    "messages": ("max_tokens",),
    "responses": ("max_output_tokens",),
}
# The refusals a request drawn to be refused must get, and nothing else: an upload's come from
# its body (parsed before anything else), a bound over its pool's `max_output_tokens` from
# placement, after the tenant's windows were looked at (so a 429 may come first).
_WRONG_REASONS = ("max_output_tokens_exceeded", "invalid_multipart")


def expected_refusal(p: Planned) -> tuple[int, ...]:
    """The statuses `p` may get when it must be refused; () when it must not be."""
    if p.upload is not None:
        if p.upload.expect is None:
            return ()
        # An oversized body may be answered (and the connection closed) before it is all sent.
        return (p.upload.expect, 0) if p.upload.expect == 413 else (p.upload.expect,)
    cap = OUTPUT_CAPS.get(p.model)
    bound = next((p.body[f] for f in _BOUNDS.get(p.endpoint, ()) if f in p.body), None)
    if cap is None or not isinstance(bound, int):
        return ()
    n = p.body.get("n", 1) if p.endpoint in ("chat", "completions") else 1
    return (400, 429) if bound * n > cap else ()


def check_refusals(run: Run) -> list[Broken]:
    """R: every request drawn to be refused got its refusal and never reached a replica; no
    upload drawn valid was refused as malformed, and no request within its pool's output bound
    was refused over it."""
    missed, wrong = [], []
    logged = _log_by_nonce(run)
    for o in run.outcomes:
        p = o.planned
        if o.left_early and p.read == "leave_upload":
            continue
        statuses = expected_refusal(p)
        reasons = [line.get("reason") for line in logged.get(p.nonce, [])]
        if statuses:
            if o.status not in statuses or run.ledger.arrivals.get(p.nonce):
                missed.append((p, o.status))
        elif any(r in _WRONG_REASONS for r in reasons) or (
            p.endpoint in SPEECH and o.status in (413, 415)
        ):
            wrong.append((p, o.status))
    out = []
    for rows, what in ((missed, "not refused as drawn"), (wrong, "refused as malformed or over")):
        if rows:
            shown = "; ".join(f"{p.endpoint}/{p.move} {status}" for p, status in rows[:6])
            out.append(
                Broken("R", f"{len(rows)} requests {what} ({shown})", [p.nonce for p, _ in rows])
            )
    return out


_MAX_MS = 3_600_000.0  # docs/api.md: an objective is milliseconds over 0, at most an hour
# A refusal as each API shapes it: OpenAI's error code, or Anthropic's 529 for a pool with no
# room, which its clients back off from (docs/api.md).
_UNREACHABLE = {"messages": (529, "overloaded_error")}


def _pool_of(p: Planned) -> str:
    return "gemma3" if p.endpoint == "passthrough" else p.model  # the passthrough route's pool


def tier_of(p: Planned) -> str:
    """The tier a request was drawn at: its tenant's, lowered (never raised) by `x-priority`,
    which only a request whose body is parsed has read."""
    tier = PRIORITIES.index(TIERS.get(p.tenant, "standard"))
    asked = next((v for n, v in p.headers if n.lower() == "x-priority"), None)
    if asked in PRIORITIES and p.endpoint != "passthrough":
        tier = max(tier, PRIORITIES.index(asked))
    return PRIORITIES[tier]


def slo_header_invalid(p: Planned) -> bool | None:
    """Whether the objective headers `p` was drawn with must be refused: None when its pool
    reads none (no `slo`, or `headers: false`, or one of the gateway's counting endpoints). Of each
    objective's names, ours first, the first sent decides, by its first value."""
    slo = SLO.get(_pool_of(p))
    if slo is None or slo.get("headers") is False or p.endpoint in COUNTING:
        return None
    sent: dict[str, str] = {}
    for name, value in p.headers:
        sent.setdefault(name.lower(), value)
    for names in zip(SLO_OURS, SLO_LLMD, strict=True):
        first = next((sent[n] for n in names if n in sent), None)
        if first is None:
            continue
        try:
            ms = float(first)
        except ValueError:
            return True
        if not 0 < ms <= _MAX_MS:
            return True
    return False


def _answered_upstream(run: Run, p: Planned) -> bool:
    """Whether a replica took `p` further than refusing it: one that resets the connection
    before its head sends it back to the queue, where a retry may find its objective
    unreachable (and be refused `slo_unreachable`) having reached that replica."""
    return bool(run.ledger.arrivals.get(p.nonce)) and p.script.transport != "reset_head"


def check_slo(run: Run) -> list[Broken]:
    """Latency objectives (issue 38): the client's objective headers and priority never reach a
    replica (X); a header no objective may take is refused and reaches no replica, and one that
    may, or one on a pool that reads none, is never refused as such (R); `slo_unreachable` goes
    only to sheddable requests on pools with `slo`, 429 (Anthropic's 529) with a Retry-After of
    a whole second or more and the API's own error body, before any replica answered (R); `llm_slo_requests_total` counts
    each request at most once per objective it had (S)."""
    out: list[Broken] = []
    leaked = sorted(
        {n for n, arrivals in run.ledger.arrivals.items() for a in arrivals if a.leaked_headers}
    )
    if leaked:
        names = sorted(
            {h for n in leaked for a in run.ledger.arrivals[n] for h in a.leaked_headers}
        )
        out.append(Broken("X", f"client-only headers reached a replica: {names}", leaked))
    logged = _log_by_nonce(run)
    hostile, wrong, unreachable = [], [], []
    for o in run.outcomes:
        p = o.planned
        if p.read == "leave_upload" and o.left_early:
            continue
        reasons = [line.get("reason") for line in logged.get(p.nonce, [])]
        invalid = slo_header_invalid(p)
        if invalid and (o.status == 200 or run.ledger.arrivals.get(p.nonce)):
            hostile.append((p, o.status))
        elif not invalid and "invalid_slo" in reasons:
            wrong.append((p, o.status))
        if "slo_unreachable" in reasons:
            status, kind = _UNREACHABLE.get(p.endpoint, (429, '"slo_unreachable"'))
            retry = o.retry_after or ""
            if (
                tier_of(p) != "sheddable"
                or _pool_of(p) not in SLO
                or o.status != status
                or not (retry.isdigit() and int(retry) >= 1)
                or kind.encode() not in o.refusal
                or _answered_upstream(run, p)
            ):
                unreachable.append((p, o.status, retry))
    for rows, what in (
        (hostile, "drawn with an objective header no objective may take, not refused"),
        (wrong, "refused `invalid_slo` though their pool reads no such header or it was valid"),
    ):
        if rows:
            shown = "; ".join(
                f"{p.endpoint}/{p.move} {status} {p.headers}"[:160] for p, status in rows[:4]
            )
            out.append(
                Broken("R", f"{len(rows)} requests {what} ({shown})", [p.nonce for p, _ in rows])
            )
    if unreachable:
        shown = "; ".join(
            f"{p.endpoint} {tier_of(p)} on {_pool_of(p)}: {status}, Retry-After {retry!r}"
            for p, status, retry in unreachable[:4]
        )
        out.append(
            Broken(
                "R",
                f"{len(unreachable)} `slo_unreachable` refusals not a sheddable request's"
                f" 429 with a Retry-After in the API's shape ({shown})",
                [p.nonce for p, _, _ in unreachable],
            )
        )
    return out + _slo_counted_once(run, logged)


def _slo_counted_once(run: Run, logged: dict[str, list[dict[str, Any]]]) -> list[Broken]:
    """Each gateway's `llm_slo_requests_total` per pool, tier and objective against the
    requests its access log shows with that objective: at most one outcome each."""
    planned = {o.planned.nonce: o.planned for o in run.outcomes}
    had: dict[tuple[int, str, str, str], int] = defaultdict(int)
    for nonce, lines in logged.items():
        for line in lines:
            for objective in ("ttft", "tpot"):
                if line.get(f"slo_{objective}_s") is not None:
                    key = (line["gateway"], line["pool"], tier_of(planned[nonce]), objective)
                    had[key] += 1
    out = []
    for i, text in enumerate(run.metrics):
        counted: dict[tuple[int, str, str, str], float] = defaultdict(float)
        for family in text_string_to_metric_families(text):
            if family.name == "llm_slo_requests":
                for sample in family.samples:
                    if sample.name == "llm_slo_requests_total":
                        labels = sample.labels
                        key = (i, labels["pool"], labels["tier"], labels["objective"])
                        counted[key] += sample.value
        over = {k: (v, had.get(k, 0)) for k, v in counted.items() if v > had.get(k, 0)}
        if over:
            shown = ", ".join(f"{k[1:]}: {v:g} counted, {n} had it" for k, (v, n) in over.items())
            out.append(
                Broken("S", f"gateway {i}: llm_slo_requests_total counted more than once ({shown})")
            )
    return out


def check(run: Run) -> list[Broken]:
    return [
        *check_quota(run),
        *check_counts(run),
        *check_loop(run),
        *check_slots(run),
        *check_leaks(run),
        *check_refusals(run),
        *check_slo(run),
    ]
