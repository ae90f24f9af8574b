"""`POST /tokenize`, `POST /detokenize` and Anthropic's `POST /v1/messages/count_tokens` as
vLLM serves them, answered by the gateway itself.

The request and response fields, their defaults and their refusals are vLLM's
(vllm/entrypoints/serve/tokenize/protocol.py and serving.py): a body with `messages` is the chat
form (rendered by the model's chat template, `add_special_tokens` false by default), one with
`prompt` the completion form (`add_special_tokens` true). The ids come from the tokenizer that
counts the model's requests, so a client that tokenizes here sees the count admission uses,
without a replica's time. A name resolves as a request's would (models, aliases, adapters, by the
routes for that form), and the body passes the same limits as a chat or completions request.

Models counted by `tokenizer: estimate` have no token ids: asking for them is a 400 that says so;
`count_tokens` counts them by estimate, as `/v1/messages` admits them.

Each answer comes with the tokens it handled (counted, or decoded), for the tenant's TPM: the
gateway's tokenizer time is paid for like a prompt's (gateway/request/quota.py `reserve_counting`).
"""

from __future__ import annotations

import time
from functools import partial
from typing import Any

from multidict import CIMultiDictProxy

from gateway.api import CHAT, COMPLETIONS, MESSAGES, Api
from gateway.api.anthropic import chat_for, check_messages
from gateway.api.chat import check_chat
from gateway.api.fields import check_model, check_prompt_chars
from gateway.config.schema import ServerSpec
from gateway.context.compiled import Model
from gateway.context.ctx import Ctx
from gateway.errors import BadRequest, ModelNotFound
from gateway.policy.compile import Policy
from gateway.request.route import find_candidates
from gateway.tokenizer.chat_template import lax_bool
from gateway.tokenizer.counters import HFCounter

MAX_TOKEN_ID = 2**63 - 1  # vLLM's bound on a `tokens` entry, before the vocabulary's


def _flag(body: dict[str, Any], name: str, default: bool, nullable: bool = False) -> bool:
    """A boolean field as pydantic reads vLLM's: missing, `default`; `null` is the default only
    where vLLM's field is `bool | None` (`return_token_strs`), a 400 elsewhere."""
    return lax_bool(body.get(name, default), name, default, nullable)


# Fields of a chat completion only: `TokenizeChatRequest` has none of them, so they render nothing.
_COMPLETION_ONLY = ("documents", "reasoning_effort")


def _default_model(policy: Policy) -> str:
    """vLLM takes a missing `model` as its one model; the gateway does while it serves one."""
    served = {pool.spec.model for pool in policy.pools.values()}
    if len(served) != 1:
        raise BadRequest("'model' is required: this gateway serves several models", param="model")
    return served.pop()


def resolve(
    policy: Policy,
    body: dict[str, Any],
    headers: CIMultiDictProxy[str],
    apis: tuple[Api, ...],
) -> Model:
    """The model whose tokenizer counts a request for `body`'s `model` on any of `apis`' endpoints
    (tried in order), or raise `ModelNotFound` (404) as the pipeline would."""
    name = body.get("model")
    name = _default_model(policy) if name is None else check_model(name)
    ctx = Ctx("", apis[0], "", headers, time.perf_counter(), requested_model=name)
    for api in apis:
        ctx.api = api
        try:
            find_candidates(ctx, policy.routes, policy.adapters)
        except ModelNotFound:
            if api is apis[-1]:
                raise
            continue
        break
    assert ctx.model is not None
    return ctx.model


def _counter(model: Model) -> HFCounter:
    counter = model.counter
    if not isinstance(counter, HFCounter):
        raise BadRequest(
            f"model {model.name!r} is counted by estimate (`tokenizer: estimate`): the gateway"
            " has no token ids for it",
            param="model",
            code="no_tokenizer",
        )
    return counter


def _check_chat(body: dict[str, Any], limits: ServerSpec) -> dict[str, Any]:
    """The chat form checked as a chat completion is (vLLM's refusals, the limits, a client's
    template refused), as `TokenizeChatRequest` sees it."""
    body = {k: v for k, v in body.items() if k not in _COMPLETION_ONLY}
    if check_chat(body, limits):
        raise BadRequest(
            "images are not tokenized by the gateway: their tokens are the replica's",
            param="messages",
            code="images_not_supported",
        )
    return body


def check_tokenize(body: dict[str, Any], limits: ServerSpec) -> dict[str, Any]:
    """A decoded `/tokenize` body, checked as its form is: the chat form as a chat completion,
    the completion form's prompt within the limits."""
    if "messages" in body:
        return _check_chat(body, limits)
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise BadRequest("'prompt' (a string) or 'messages' is required", param="prompt")
    check_prompt_chars(len(prompt), limits, "prompt")
    return body


async def tokenize(
    policy: Policy, body: dict[str, Any], headers: CIMultiDictProxy[str]
) -> tuple[dict[str, Any], int]:
    """vLLM's `TokenizeResponse` for a checked body (`check_tokenize`): `count`,
    `max_model_len`, `tokens`, `token_strs` (null unless `return_token_strs`); and the count."""
    chat = "messages" in body
    api = CHAT if chat else COMPLETIONS
    special = _flag(body, "add_special_tokens", not chat)
    strs = _flag(body, "return_token_strs", False, nullable=True)
    model = resolve(policy, body, headers, (api,))
    counter = _counter(model)
    ids = await api.prompt_ids(body, counter, special)
    assert ids is not None  # a text, or a chat: always encoded
    answer = {
        "count": len(ids),
        "max_model_len": model.spec.max_model_len,
        "tokens": ids,
        "token_strs": await counter.token_strs(ids) if strs else None,
    }
    return answer, len(ids)


def check_detokenize(body: dict[str, Any], limits: ServerSpec) -> dict[str, Any]:
    """A decoded `/detokenize` body whose `tokens` are ids."""
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(
        type(t) is int and 0 <= t <= MAX_TOKEN_ID for t in tokens
    ):
        raise BadRequest(
            "'tokens' must be an array of non-negative integer token ids", param="tokens"
        )
    return body


async def detokenize(
    policy: Policy, body: dict[str, Any], headers: CIMultiDictProxy[str]
) -> tuple[dict[str, str], int]:
    """vLLM's `DetokenizeResponse`, `{"prompt": text}`, for a checked body
    (`check_detokenize`), and the ids decoded; an id outside the vocabulary is a 400 (vLLM's
    decode skips or fails on it)."""
    tokens = body["tokens"]
    counter = _counter(resolve(policy, body, headers, (COMPLETIONS, CHAT)))
    unknown = next((t for t in tokens if t >= counter.vocab_size), None)
    if unknown is not None:
        raise BadRequest(f"Token id {unknown} is out of vocabulary", param="tokens")
    return {"prompt": await counter.decode(tokens)}, len(tokens)


def check_count_tokens(body: dict[str, Any], limits: ServerSpec) -> dict[str, Any]:
    """A decoded `count_tokens` body, checked as `/v1/messages` checks its own. A count is the
    tokenizer's alone: images, whose tokens are the replica's processor's, are refused as
    `/tokenize` refuses them."""
    if check_messages(body, limits, None):
        raise BadRequest(
            "images are not counted by the gateway: their tokens are the replica's",
            param="messages",
            code="images_not_supported",
        )
    return body


async def count_tokens(
    policy: Policy, body: dict[str, Any], headers: CIMultiDictProxy[str]
) -> tuple[dict[str, Any], int]:
    """Anthropic's `messages.count_tokens` as vLLM answers it (`AnthropicCountTokensResponse`)
    for a checked body (`check_count_tokens`), and the count: the chat its messages convert to,
    rendered and counted whole by the model's counter, as `/v1/messages` counts them
    (gateway/api/anthropic.py), an estimate's included."""
    counter = resolve(policy, body, headers, (MESSAGES,)).counter
    tokens = await counter.count_chat(body, to_chat=partial(chat_for, counter=counter))
    answer = {"input_tokens": tokens, "context_management": {"original_input_tokens": tokens}}
    return answer, tokens
