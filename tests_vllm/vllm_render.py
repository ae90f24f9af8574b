"""vLLM 0.32's own `/v1/chat/completions` prompt path, run without a model: the token count (or
the refusal) vLLM gives each chat request, for a tokenizer directory.

Run by tests_vllm/test_render_parity.py in vLLM's environment (`$VLLM_PYTHON`; the project's
venv has no vLLM), as a script: it imports vLLM only, nothing of the repository.

    $VLLM_PYTHON tests_vllm/vllm_render.py < requests.json > results.json

stdin: a list of jobs `{"tokenizer": DIR, "max_model_len": N, "tool_parser": NAME or null,
"bodies": [BODY, ...], "api": "chat" | "messages" | "responses" | "responses_chain"}`
(`messages`: the bodies are `/v1/messages` ones, converted to a chat as vLLM's Anthropic serving
converts them, then counted alike; `responses`: `/v1/responses` ones, rendered by
`render_responses`; `responses_chain`: conversations continued by `previous_response_id`, a
count per turn); stdout: `{"results": [[RESULT, ...], ...], "read": [...]}`, a result per body
per job, `{"tokens": N, "prompt": RENDERED}` or `{"refused": STATUS, "error": "Type:
message"}`, and the model-config attributes vLLM read.

The path is the serving path's own code, in its order:
1. the request body validated into `ChatCompletionRequest` as FastAPI does (pydantic, python
   mode, on the JSON-decoded body): its `model_validator`s (`_normalize_messages_before`:
   `reasoning_content` -> `reasoning`; `check_generation_prompt`; tool checks; ...) and the
   message TypedDicts; a failure is FastAPI's RequestValidationError, a 400;
2. `OnlineRenderer.render_chat` (renderers/online_renderer.py), built as
   `entrypoints/launchers/api_server/app_state.py` builds it with `vllm serve`'s defaults (no
   chat template flag, `--chat-template-content-format auto`, no reasoning parser, untrusted
   request templates) but for the job's `--enable-auto-tool-choice --tool-call-parser`: tool_choice check, `tool.model_dump()`,
   `validate_chat_template`, `preprocess_chat` (ChatParams from `build_chat_params`, tokenize
   params from `build_tok_params`), then the renderer's `render_chat_async`:
   - `HfRenderer.render_messages_async` (renderers/hf.py): `parse_chat_messages_async`
     (renderers/chat_utils.py) with the content format from
     `resolve_chat_template_content_format`, then `safe_apply_chat_template` (template
     resolution, developer role, `resolve_chat_template_kwargs`, the tokenizer's
     `apply_chat_template(tokenize=False)`), `parse_dec_only_prompt`;
   - `BaseRenderer.tokenize_prompts_async` (renderers/base.py): pre-tokenization checks, the
     tokenizer's `__call__` with the chat's encode kwargs (no special tokens), post-tokenization
     length checks against `max_model_len`;
   - `process_for_engine_async`: the engine input whose `prompt_token_ids` vLLM counts as
     `usage.prompt_tokens`.
   The renderer comes from `renderer_from_config` (renderers/registry.py), its tokenizer from
   `cached_tokenizer_from_config` (tokenizers/registry.py), as `vllm serve` loads them.
3. An exception is mapped to its HTTP status by vLLM's own `create_error_response`
   (entrypoints/serve/exception_handling/error_response.py), as the app's handlers do.

What cannot run without a model: `OpenAIServingChat._check_model` (the served name) and
`_preflight` (engine health), neither of which reads the messages. There is no ModelConfig
without the model's config.json, so `ModelConfig` below is a duck-typed stand-in with the
attributes this text-only path reads (it records them, reported after the results).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
from typing import Any

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


class HfConfig:
    """`model_config.hf_config`: only its `model_type` is read on this path (harmony detection,
    the chat-template fallback table, tool-call id style); a model type with none of those."""

    model_type = "parity-test"


class ModelConfig:
    """A stand-in for vllm.config.ModelConfig: a generative text-only model served by `vllm
    serve` with its defaults. Every attribute read is recorded in `READ`."""

    READ: set[str] = set()

    def __init__(self, tokenizer: str, max_model_len: int) -> None:
        values = {
            "model": tokenizer,
            "tokenizer": tokenizer,
            "tokenizer_mode": "auto",
            "tokenizer_revision": None,
            "revision": None,
            "code_revision": None,
            "trust_remote_code": False,
            "skip_tokenizer_init": False,
            "runner_type": "generate",
            "max_model_len": max_model_len,
            "hf_config": HfConfig(),
            "hf_text_config": HfConfig(),
            "hf_overrides": {},
            "encoder_config": None,
            "enable_prompt_embeds": False,
            "multimodal_config": None,
            "supports_multimodal_inputs": False,
            "is_multimodal_model": False,
            "renderer_num_workers": 1,
            "allowed_local_media_path": "",
            "allowed_media_domains": None,
            "is_encoder_decoder": False,
            "generation_config": "auto",
        }
        object.__setattr__(self, "_values", values)

    def __getattr__(self, name: str) -> Any:
        values = object.__getattribute__(self, "_values")
        if name not in values:
            raise AttributeError(f"ModelConfig stand-in has no {name!r}")
        ModelConfig.READ.add(name)
        return values[name]


class ParallelConfig:
    _api_process_rank = 0
    _api_process_count = 1


class VllmConfig:
    def __init__(self, model_config: ModelConfig) -> None:
        self.model_config = model_config
        self.parallel_config = ParallelConfig()


def build(tokenizer: str, max_model_len: int, tool_parser: str | None) -> Any:
    """The OnlineRenderer `vllm serve` builds for a model whose tokenizer is `tokenizer`, with
    `--enable-auto-tool-choice --tool-call-parser TOOL_PARSER` when one is named."""
    from vllm.renderers.online_renderer import OnlineRenderer
    from vllm.renderers.registry import renderer_from_config

    model_config = ModelConfig(tokenizer, max_model_len)
    renderer = renderer_from_config(VllmConfig(model_config))
    return OnlineRenderer(
        model_config=model_config,  # type: ignore[arg-type]
        renderer=renderer,
        request_logger=None,
        chat_template=None,  # load_chat_template(None)
        chat_template_content_format="auto",
        trust_request_chat_template=False,
        trust_request_mm_kwargs=False,
        enable_auto_tools=tool_parser is not None,
        exclude_tools_when_tool_choice_none=False,
        tool_parser=tool_parser,
        tool_strict_level="auto",
        reasoning_parser=None,
        default_chat_template_kwargs=None,  # resolve_default_chat_template_kwargs: none given
        log_error_stack=False,
    )


def refused(exc: Exception) -> dict[str, Any]:
    """The app's exception handlers: `create_error_response(exc)` gives the status."""
    from vllm.entrypoints.serve.exception_handling.error_response import create_error_response

    status = create_error_response(exc).error.code
    return {"refused": status, "error": f"{type(exc).__name__}: {exc}"[:500]}


async def count(online: Any, body: dict[str, Any]) -> dict[str, Any]:
    from pydantic import ValidationError
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.serve.exception_handling.handlers.validation import (
        clean_loc_for_param,
    )

    try:
        request = ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:  # FastAPI: RequestValidationError -> 400
        first = exc.errors()[0]
        where = clean_loc_for_param(first.get("loc") or ())
        return {"refused": 400, "error": f"RequestValidationError: {where}: {first['msg']}"}
    except Exception as exc:  # a model_validator's own VLLMValidationError, raised through
        return refused(exc)
    return await render(online, request)


async def convert(online: Any, body: dict[str, Any]) -> Any:
    """A `/v1/messages` body as vLLM's Anthropic serving turns it into a chat request:
    `AnthropicMessagesRequest` validated, then `to_chat_completion_request` with inline system
    messages merged when the renderer's templates need it (`_should_merge_inline_system`), and
    `thinking: disabled` as the effort `_probe_disabled_thinking_effort` finds on the renderer
    (the serving's own methods, on a stand-in holding only what they read)."""
    from types import SimpleNamespace

    from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest
    from vllm.entrypoints.anthropic.serving import AnthropicServingMessages
    from vllm.renderers.inputs.preprocess import extract_prompt_components

    request = AnthropicMessagesRequest.model_validate(body)
    merge = AnthropicServingMessages._should_merge_inline_system(online)
    effort = "none"
    if request.thinking is not None and request.thinking.type == "disabled":
        serving = SimpleNamespace(online_renderer=online)
        serving._extract_prompt_components = lambda prompt: extract_prompt_components(
            online.model_config, prompt
        )
        serving._render_probe_prompt = lambda e: AnthropicServingMessages._render_probe_prompt(
            serving, e
        )
        effort = await AnthropicServingMessages._probe_disabled_thinking_effort(serving)
    return AnthropicServingMessages.to_chat_completion_request(
        request, merge_inline_system=merge, disabled_thinking_effort=effort
    )


async def count_messages(online: Any, body: dict[str, Any]) -> dict[str, Any]:
    from pydantic import ValidationError

    try:
        request = await convert(online, body)
    except ValidationError as exc:
        return {"refused": 400, "error": f"RequestValidationError: {exc.errors()[0]['msg']}"}
    except Exception as exc:
        return refused(exc)
    return await render(online, request)


async def render(online: Any, request: Any) -> dict[str, Any]:
    """`render_chat` of a validated chat request: its count, or vLLM's refusal."""
    from pydantic import ValidationError
    from vllm.entrypoints.serve.exception_handling.error_response import create_error_response
    from vllm.entrypoints.serve.exception_handling.handlers.validation import (
        clean_loc_for_param,
    )

    try:
        result = await online.render_chat(request)
    except ValidationError as exc:
        # Content arrays a message TypedDict types as `Iterable[...]` are validated lazily
        # (pydantic's ValidatorIterator), when the parser first iterates them: a ValueError.
        first = exc.errors()[0]
        where = clean_loc_for_param(first.get("loc") or ())
        status = create_error_response(exc).error.code
        return {
            "refused": status,
            "error": f"ValidationError while parsing: {where}: {first['msg']}",
        }
    except Exception as exc:
        return refused(exc)
    if not isinstance(result, tuple):  # an ErrorResponse
        return {"refused": result.error.code, "error": f"ErrorResponse: {result.error.message}"}
    _, (engine_input,) = result
    return {"tokens": len(engine_input["prompt_token_ids"]), "prompt": engine_input.get("prompt")}


async def count_responses(online: Any, body: dict[str, Any]) -> dict[str, Any]:
    """A `/v1/responses` body as vLLM's Responses serving renders it (no stored response to
    continue): `ResponsesRequest` validated, its input checks, `render_responses`."""
    from types import SimpleNamespace

    from pydantic import ValidationError
    from vllm.entrypoints.openai.responses.protocol import ResponsesRequest
    from vllm.entrypoints.openai.responses.serving import OpenAIServingResponses

    try:
        request = ResponsesRequest.model_validate(body)
        serving = SimpleNamespace(
            use_harmony=False,
            enable_store=False,
            create_error_response=online.create_error_response,
        )
        error = OpenAIServingResponses._validate_create_responses_input(serving, request)
        result = error or await online.render_responses(request)
    except ValidationError as exc:
        return {"refused": 400, "error": f"RequestValidationError: {exc.errors()[0]['msg']}"}
    except Exception as exc:
        return refused(exc)
    if not hasattr(result, "engine_input"):  # an ErrorResponse
        return {"refused": result.error.code, "error": f"ErrorResponse: {result.error.message}"}
    engine_input = result.engine_input
    return {"tokens": len(engine_input["prompt_token_ids"]), "prompt": engine_input.get("prompt")}


async def count_responses_chain(online: Any, chain: dict[str, Any]) -> dict[str, Any]:
    """A conversation continued turn by turn (`{"turns": [{"body": BODY, "output": ITEMS}]}`),
    each turn rendered as vLLM's Responses serving with its store on renders a request whose
    `previous_response_id` names the turn before (`_render_resolved_response_inputs`): the
    messages that turn rendered (its `msg_store` entry, a copy) and its response's `output`
    (`response_store`; here the chain's own items, validated as the response's), through
    `render_responses`. `{"tokens": [N, ...]}`, a count per turn, or the first refusal."""
    from openai.types.responses import ResponseOutputItem
    from pydantic import TypeAdapter, ValidationError
    from vllm.entrypoints.openai.responses.protocol import ResponsesRequest

    outputs = TypeAdapter(list[ResponseOutputItem])
    counts = []
    messages: Any = None
    output: Any = None
    for turn in chain["turns"]:
        try:
            request = ResponsesRequest.model_validate(turn["body"])
            result = await online.render_responses(
                request,
                previous_messages=None if messages is None else messages.copy(),
                previous_response_outputs=output,
            )
        except ValidationError as exc:
            return {"refused": 400, "error": f"RequestValidationError: {exc.errors()[0]['msg']}"}
        except Exception as exc:
            return refused(exc)
        if not hasattr(result, "engine_input"):  # an ErrorResponse
            return {"refused": result.error.code, "error": f"ErrorResponse: {result.error.message}"}
        counts.append(len(result.engine_input["prompt_token_ids"]))
        messages, output = result.messages, outputs.validate_python(turn["output"])
    return {"tokens": counts}


COUNTERS = {
    "chat": count,
    "messages": count_messages,
    "responses": count_responses,
    "responses_chain": count_responses_chain,
}


async def main() -> None:
    logging.disable(logging.WARNING)
    out = []
    for job in json.load(sys.stdin):
        online = build(job["tokenizer"], job["max_model_len"], job.get("tool_parser"))
        counting = COUNTERS[job.get("api", "chat")]
        out.append([await counting(online, body) for body in job["bodies"]])
    json.dump({"results": out, "read": sorted(ModelConfig.READ)}, sys.stdout)


if __name__ == "__main__":
    asyncio.run(main())
