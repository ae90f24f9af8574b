"""The generative adversary's short profile: issue 35's promises Q, C, L and S (and no redirect
followed) after a seeded run of random requests on every endpoint against the real gateway as a
process, behind a replica that lies on cue; one gateway, and two sharing a real `redis-server`
that is stopped and restarted mid-run. Two fixed seeds, and one fresh seed each session, printed
in the failure with the command that replays it. The long profile is `make fuzz`."""

from __future__ import annotations

from pathlib import Path

import pytest

from loadtest.adversary.checks import check
from loadtest.adversary.count import messages_chat
from loadtest.adversary.generator import fresh_seed
from loadtest.adversary.harness import execute

SECONDS = 10.0  # of attack; the gateways' start (three real tokenizers) takes longer than that

FRESH = fresh_seed()


@pytest.mark.parametrize(
    ("seed", "gateways"), [(35, 1), (36, 2), (FRESH, 1)], ids=["fixed-one", "fixed-two", "fresh"]
)
async def test_promises_hold_against_the_adversary(tmp_path: Path, seed: int, gateways: int):
    run = await execute(seed, SECONDS, gateways, tmp_path, backend="tokenizers")
    assert run.outcomes, "the adversary sent nothing"
    broken = check(run)
    replay = (
        f"replay: python -m loadtest.adversary --seed {seed} --seconds {SECONDS:g}"
        f" --gateways {gateways} --backend tokenizers"
    )
    assert not broken, "\n".join([*(b.line(seed) for b in broken), replay])


def test_the_independent_count_converts_messages_as_vllm_does() -> None:
    """vLLM's Anthropic server drops empty text blocks, makes one text block a string and drops
    a user message left with none (`_convert_message_content`): found by the long profile, where
    the count had kept an empty block as a trailing line."""
    body = {
        "system": [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}],
        "messages": [
            {
                "role": "user",
                "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": ""}],
            },
            {"role": "assistant", "content": "hello"},
            {"role": "user", "content": [{"type": "text", "text": ""}]},
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
        ],
    }
    assert messages_chat(body) == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    ]
