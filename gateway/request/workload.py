"""The classify stage: name the request's workload from its token shape (first matching class wins).

Capacity is decided by input and output length, not by API name: a summarisation call with a long
output behaves like generation, a 4,000-in / 10-out review like classification.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.config.schema import ClassSpec
from gateway.context.ctx import Ctx
from gateway.context.match import Check, all_of, in_range, request_checks


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    matches: Check


def compile_class(spec: ClassSpec) -> Workload:
    when = spec.when
    checks = request_checks(when.model, when.endpoint, when.header)
    if when.input_tokens is not None:
        isl = in_range(when.input_tokens)
        checks.append(lambda ctx: isl(ctx.input_tokens))
    if when.output_tokens is not None:
        osl = in_range(when.output_tokens)
        checks.append(lambda ctx: osl(ctx.expected_output))
    if when.output_input_ratio is not None:
        ratio = in_range(when.output_input_ratio)
        checks.append(lambda ctx: ratio(ctx.expected_output / max(1, ctx.input_tokens)))
    return Workload(spec.name, all_of(checks))


UNCLASSIFIED = "unclassified"


def classify(ctx: Ctx, workloads: tuple[Workload, ...]) -> None:
    for workload in workloads:
        if workload.matches(ctx):
            ctx.workload = workload.name
            return
    ctx.workload = UNCLASSIFIED
