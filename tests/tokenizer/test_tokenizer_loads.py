"""A tokenizer directory is loaded once, whatever number of models name it and reloads keep it
(gateway/tokenizer/loaded.py); where fastokens counts, the transformers tokenizer is let go and
fastokens decodes too."""

from __future__ import annotations

import gc
import os
import shutil
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from gateway.config.load import load_spec
from gateway.policy.compile import compile_policy, load_policy, reference_problems
from gateway.tokenizer import loaded
from gateway.tokenizer.backends import FastokensEncoder, TransformersDecoder
from gateway.tokenizer.counters import HFCounter
from tests.conftest import basic_policy, write_policy


def three_models(directory: Path, tmp_path: Path, **tiny: object) -> Path:
    """Three models naming one directory, spelled three ways (a symlink, a `..`)."""
    link = tmp_path / "link"
    if not link.exists():
        link.symlink_to(directory)
    policy = basic_policy(directory, ["http://127.0.0.1:9"])
    policy["models"]["tiny"].update(tiny)
    for name, spelled in (("b", link), ("c", directory / ".." / directory.name)):
        policy["models"][name] = {"tokenizer": str(spelled), "max_model_len": 4096}
        policy["pools"][name] = {
            "model": name,
            "replicas": ["http://127.0.0.1:9"],
            "max_concurrency": 1,
        }
        policy["routes"].insert(0, {"match": {"model": name}, "pool": name})
    return write_policy(tmp_path, policy)


def counters(policy) -> list[HFCounter]:  # type: ignore[no-untyped-def]
    found = [m.counter for m in policy.models.values()]
    assert all(isinstance(c, HFCounter) for c in found)
    return found


def test_models_naming_one_directory_share_one_load(tokenizer_dir: Path, tmp_path: Path) -> None:
    policy = load_policy(three_models(tokenizer_dir, tmp_path))
    try:
        tiny, b, c = counters(policy)
        assert tiny.encoder is b.encoder is c.encoder
        assert tiny.template is b.template is c.template
        # each model keeps its own settings over the shared load
        assert tiny.threads is b.threads and tiny.image_cost == b.image_cost == 0
    finally:
        policy.close()


def test_another_backend_is_another_load(tokenizer_dir: Path, tmp_path: Path) -> None:
    policy = load_policy(three_models(tokenizer_dir, tmp_path, tokenizer_backend="tokenizers"))
    try:
        tiny, b, _ = counters(policy)
        assert (tiny.backend, b.backend) == ("tokenizers", "fastokens")
        assert tiny.encoder is not b.encoder
    finally:
        policy.close()


def test_a_reload_keeps_the_load_until_the_files_change(
    tokenizer_dir: Path, tmp_path: Path
) -> None:
    directory = Path(shutil.copytree(tokenizer_dir, tmp_path / "tokenizer"))
    path = three_models(directory, tmp_path)
    first = load_policy(path)
    # Every model's spec changes (so none is carried over as it is): the files are the same.
    path.write_text(path.read_text().replace("max_model_len: 4096", "max_model_len: 2048"))
    path.write_text(path.read_text().replace("max_model_len: 8192", "max_model_len: 2048"))
    second = compile_policy(load_spec(path, reference_problems), previous=first)
    assert all(m.spec.max_model_len == 2048 for m in second.models.values())
    assert counters(second)[0].encoder is counters(first)[0].encoder
    # kubelet's swap of a mounted directory, or a new file written: loaded anew.
    config = directory / "tokenizer_config.json"
    config.write_text(config.read_text())
    os.utime(config, ns=(0, 0))
    third = compile_policy(load_spec(path, reference_problems), previous=second)
    try:
        assert counters(third)[0].encoder is not counters(second)[0].encoder
        assert len({id(c.encoder) for c in counters(third)}) == 1
    finally:
        for policy in (first, second, third):
            policy.close()


def test_a_workers_unchanged_reload_keeps_its_models_and_its_share_of_the_cpus(
    tokenizer_dir: Path, tmp_path: Path
) -> None:
    """A pod's worker starts its share of the CPUs as tokenizer threads without writing it into
    its policy, so a reload of the same file is the same policy: nothing is loaded again."""
    path = three_models(tokenizer_dir, tmp_path)
    first = compile_policy(load_spec(path, reference_problems), share=64)
    second = compile_policy(load_spec(path, reference_problems), previous=first, share=64)
    try:
        assert first.tokenizer_threads is not None
        assert first.tokenizer_threads.small.threads == 1  # a 64th of the CPUs, rounded up
        assert second.digest == first.digest
        assert all(second.models[n] is first.models[n] for n in first.models)
    finally:
        second.close()
        first.close()


def test_a_load_no_policy_holds_is_freed(tokenizer_dir: Path, tmp_path: Path) -> None:
    # A copy of its own: another test's policy still alive may hold the shared directory's load.
    own = shutil.copytree(tokenizer_dir, tmp_path / "tokenizer")
    policy = load_policy(three_models(own, tmp_path))
    identity = counters(policy)[0].loaded.identity
    assert identity in loaded._loaded
    policy.close()
    del policy
    gc.collect()
    assert identity not in loaded._loaded


async def test_where_fastokens_counts_it_decodes_too_and_nothing_is_loaded_after_the_policy(
    tokenizer_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A load after the policy's (the transformers tokenizer again, for a first `/detokenize`)
    held the event loop for hundreds of milliseconds: decoding needs none."""
    own = shutil.copytree(tokenizer_dir, tmp_path / "tokenizer")
    policy = load_policy(write_policy(tmp_path, basic_policy(own, ["http://127.0.0.1:9"])))
    try:
        (counter,) = counters(policy)
        assert counter.backend == "fastokens" and counter.loaded.decoder is counter.encoder

        def no_load(directory: str) -> None:
            raise AssertionError(f"{directory} loaded again after the policy")

        monkeypatch.setattr(loaded, "load_tokenizer", no_load)
        reference = AutoTokenizer.from_pretrained(str(tokenizer_dir))
        ids = [*reference.encode("Hello there, general decoding"), 0, counter.vocab_size - 1]
        assert await counter.decode(ids) == reference.decode(ids)
        assert await counter.token_strs(ids) == reference.convert_ids_to_tokens(ids)
        assert counter.vocab_size == len(reference)
    finally:
        policy.close()


def test_a_tokenizer_fastokens_fails_to_decode_is_decoded_by_transformers(
    tokenizer_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """fastokens raising on a probe is a disagreement, not a policy that fails to load."""

    def fails(self: FastokensEncoder, ids: list[int]) -> str:
        raise ValueError("cannot decode")

    monkeypatch.setattr(FastokensEncoder, "decode", fails)
    _counts_with_fastokens_and_decodes_with_transformers(tokenizer_dir, tmp_path)


def test_a_tokenizer_fastokens_does_not_decode_alike_keeps_transformers_to_decode(
    tokenizer_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(loaded, "decoding_disagreement", lambda fast, tokenizer: "ids [0]")
    _counts_with_fastokens_and_decodes_with_transformers(tokenizer_dir, tmp_path)


def _counts_with_fastokens_and_decodes_with_transformers(
    tokenizer_dir: Path, tmp_path: Path
) -> None:
    own = shutil.copytree(tokenizer_dir, tmp_path / "tokenizer")
    policy = load_policy(write_policy(tmp_path, basic_policy(own, ["http://127.0.0.1:9"])))
    try:
        (counter,) = counters(policy)
        assert counter.backend == "fastokens"
        assert isinstance(counter.loaded.decoder, TransformersDecoder)
    finally:
        policy.close()
