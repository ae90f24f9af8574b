"""The authenticate stage: `Authorization: Bearer <key>` (or, as Anthropic's clients send it,
`x-api-key: <key>`) names the tenant, before the body is read.

The policy holds keys only as SHA-256 hashes (raw keys may come from a Secret file or the
environment and are hashed at load), so the key table is `{digest: Tenant}` and a request costs
one hash and one dict lookup. Looking up a digest leaks nothing useful through timing: a caller
who can steer the lookup controls the key, not its hash. Without tenants the gateway is open.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from pathlib import Path

from gateway.config.load import Problem
from gateway.config.schema import PRIORITIES, TenantSpec
from gateway.context.compiled import Tenant
from gateway.context.ctx import Ctx
from gateway.context.objective import seconds
from gateway.errors import InvalidApiKey

_HASH_PREFIX = "sha256:"


def _digest(entry: str) -> bytes:
    """A key's digest from a policy entry: `sha256:<hex>` as given, anything else is a raw key."""
    if entry.startswith(_HASH_PREFIX):
        return bytes.fromhex(entry[len(_HASH_PREFIX) :])
    return hashlib.sha256(entry.encode()).digest()


def key_entry(key: str) -> str:
    """What a tenant's `keys` takes for `key`: its SHA-256, never the key (`llm-gateway
    hash-key` prints it)."""
    return _HASH_PREFIX + _digest(key).hex()


def _entries(name: str, spec: TenantSpec, base: Path) -> tuple[list[str], list[Problem]]:
    entries, problems = list(spec.keys), []
    if spec.keys_file is not None:
        try:
            entries += (base / spec.keys_file).read_text(encoding="utf-8").split()
        except OSError as exc:
            problems.append(
                Problem(("tenants", name, "keys_file"), f"cannot read: {exc.strerror or exc}")
            )
    if spec.keys_env is not None:
        value = os.environ.get(spec.keys_env, "").split()
        if not value:
            problems.append(Problem(("tenants", name, "keys_env"), f"{spec.keys_env} is not set"))
        entries += value
    return entries, problems


def compile_tenants(
    specs: Mapping[str, TenantSpec], base: Path
) -> tuple[dict[bytes, Tenant], list[Problem]]:
    """The key table; a key shared by two tenants, or a malformed hash, is a policy problem."""
    keys: dict[bytes, Tenant] = {}
    problems: list[Problem] = []
    for name, spec in specs.items():
        tenant = Tenant(name, spec, PRIORITIES.index(spec.tier), seconds(spec.slo))
        entries, found = _entries(name, spec, base)
        problems += found
        for entry in entries:
            try:
                digest = _digest(entry)
            except ValueError:
                digest = b""
            if len(digest) != hashlib.sha256().digest_size:
                problems.append(
                    Problem(("tenants", name), "a `sha256:` entry is not 64 hex digits")
                )
                continue
            other = keys.setdefault(digest, tenant)
            if other is not tenant:  # the problem names the tenants, never the key
                problems.append(
                    Problem(("tenants", name), f"a key of this tenant is also {other.name!r}'s")
                )
    return keys, problems


def identify(headers: Mapping[str, str], keys: Mapping[bytes, Tenant]) -> Tenant | None:
    """The tenant the bearer key (else the `x-api-key`) names, or raise 401; None without
    tenants (the gateway is open)."""
    if not keys:
        return None
    authorization = headers.get("Authorization")
    if authorization is None:  # Anthropic's clients send the key in `x-api-key`
        scheme, key = "bearer", headers.get("x-api-key", "")
    else:
        scheme, _, key = authorization.partition(" ")
    key = key.strip()
    if scheme.lower() != "bearer" or not key:
        raise InvalidApiKey(
            "You didn't provide an API key: send `Authorization: Bearer <key>` or `x-api-key`."
        )
    tenant = keys.get(hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest())
    if tenant is None:
        raise InvalidApiKey("Incorrect API key provided.")
    return tenant


def authenticate(ctx: Ctx, keys: Mapping[bytes, Tenant]) -> None:
    """Set `ctx.tenant` and its tier from the bearer key, or raise 401."""
    tenant = identify(ctx.headers, keys)
    if tenant is not None:
        ctx.tenant = tenant
        ctx.tier = ctx.priority = tenant.tier
