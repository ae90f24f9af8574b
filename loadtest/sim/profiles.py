"""Replica profiles: hardware, model architecture and serving flags, read from YAML once.

A profile file names a hardware file and a model file (under `hardware/` and `models/` next to
it) or inlines them, and gives vLLM's serving flags. Everything the engine needs is derived
here, once, into a `CacheGeometry` (how many KV-cache blocks fit, what a sequence holds) so
that the step loop only does arithmetic. Units: bytes, FLOP, seconds; sizes in YAML are plain
numbers so that a reader can check them against their source without unit conversions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

PROFILE_DIR = Path(__file__).resolve().parent.parent / "profiles"
"""The bundled profiles: `loadtest/profiles/*.yaml`, with `hardware/` and `models/` beside them."""

PositiveInt = Annotated[int, Field(ge=1)]
PositiveFloat = Annotated[float, Field(gt=0)]
Fraction = Annotated[float, Field(gt=0, le=1)]


class Spec(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Hardware(Spec):
    """One replica's accelerators, and how close to their peaks a step runs."""

    name: str
    chips: PositiveInt
    peak_flops_per_chip: PositiveFloat = Field(description="Dense bf16 FLOP/s per chip.")
    hbm_bytes_per_chip: PositiveFloat
    hbm_bandwidth_per_chip: PositiveFloat = Field(description="Bytes/s per chip.")
    compute_efficiency: Fraction = Field(description="Achieved / peak FLOP/s in a step's matmuls.")
    memory_efficiency: Fraction = Field(description="Achieved / peak HBM bandwidth.")
    step_overhead_s: float = Field(
        ge=0, description="Per step, on top of the roofline: scheduling, launch, sampling, sync."
    )


class ModelArch(Spec):
    """A decoder's shape, as in its Hugging Face config; parameter counts are derived from it."""

    name: str
    hidden_size: PositiveInt
    intermediate_size: PositiveInt
    num_layers: PositiveInt
    num_attention_heads: PositiveInt
    num_kv_heads: PositiveInt
    head_dim: PositiveInt
    vocab_size: PositiveInt
    sliding_window: PositiveInt | None = Field(
        None, description="Tokens a local (sliding-window) layer attends to; None: all global."
    )
    sliding_window_pattern: PositiveInt | None = Field(
        None,
        description="Every Nth layer is global, the others local (HF `sliding_window_pattern`).",
    )
    vision_params: int = Field(0, ge=0, description="Held in HBM, never read for text requests.")
    reported_params: PositiveInt | None = Field(
        None, description="The published total, checked against the derived one (within 2%)."
    )
    dtype_bytes: PositiveInt = 2
    tied_embeddings: bool = Field(
        True,
        description=(
            "The output head is the token embedding (Gemma); false: a matrix of its own (Llama),"
            " held in HBM beside it."
        ),
    )

    @model_validator(mode="after")
    def _consistent(self) -> ModelArch:
        if (self.sliding_window is None) != (self.sliding_window_pattern is None):
            raise ValueError("give both sliding_window and sliding_window_pattern, or neither")
        if self.reported_params is not None:
            derived = self.total_params
            if abs(derived - self.reported_params) > 0.02 * self.reported_params:
                raise ValueError(
                    f"the architecture gives {derived:,} parameters but reported_params is "
                    f"{self.reported_params:,}: a field is wrong"
                )
        return self

    @property
    def layer_params(self) -> int:
        """Matmul weights of all decoder layers: q, k, v, o projections and the gated MLP."""
        q = self.num_attention_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        attention = self.hidden_size * (2 * q + 2 * kv)
        mlp = 3 * self.hidden_size * self.intermediate_size
        return self.num_layers * (attention + mlp)

    @property
    def embedding_params(self) -> int:
        """The output head (vocabulary x hidden), which a step reads; with tied embeddings
        (Gemma) it is the token embedding too, stored once."""
        return self.vocab_size * self.hidden_size

    @property
    def total_params(self) -> int:
        """What HBM holds: an untied model's input embedding besides its head."""
        heads = 1 if self.tied_embeddings else 2
        return self.layer_params + heads * self.embedding_params + self.vision_params

    @property
    def global_layers(self) -> int:
        if self.sliding_window_pattern is None:
            return self.num_layers
        return self.num_layers // self.sliding_window_pattern

    @property
    def local_layers(self) -> int:
        return self.num_layers - self.global_layers

    @property
    def kv_bytes_per_layer_token(self) -> int:
        """One token's K and V in one layer."""
        return 2 * self.num_kv_heads * self.head_dim * self.dtype_bytes


class Serving(Spec):
    """vLLM's serving flags (the article's `vllm serve ...` line) and its memory budget."""

    max_model_len: PositiveInt
    max_num_batched_tokens: PositiveInt
    max_num_seqs: PositiveInt
    block_size: PositiveInt | Literal["tpu"] = Field(
        16, description="KV-cache block size in tokens; 'tpu': what tpu-inference picks."
    )
    gpu_memory_utilization: Fraction = 0.9
    activation_reserve_bytes: float = Field(
        ge=0, description="Non-KV, non-weight memory vLLM's profiling run would reserve."
    )

    @property
    def kv_block_size(self) -> int:
        """The block size vLLM would run with.

        16 is vLLM's default. On TPU, tpu-inference overrides an unset `--block-size`
        (`tpu_inference/platforms/tpu_platform.py`, `check_and_update_config`) with
        `PallasAttentionBackend.get_page_size`, 16 when `max_model_len` > 8192, raised to
        `get_min_page_size` (`tpu_inference/layers/vllm/backends/flash_attn.py`) so that the
        block tables, `max_num_seqs` x pages per request x 4 bytes, fit in half of the 1 MiB
        SMEM: the next power of two of max_model_len / (2**19 // max_num_seqs // 4).
        """
        if self.block_size != "tpu":
            return self.block_size
        page = (
            16 if self.max_model_len > 8192 else min(256, max(16, _pow2(self.max_model_len) // 16))
        )
        pages_per_request = 1024 * 1024 // 2 // self.max_num_seqs // 4
        return max(page, _pow2(-(-self.max_model_len // pages_per_request)))


def _pow2(n: int) -> int:
    """The smallest power of two not below `n` (vLLM's next_power_of_2)."""
    return 1 << (n - 1).bit_length() if n > 1 else 1


class OutputLengths(Spec):
    """Output length when a request does not set `ignore_eos`: the model stops on its own."""

    distribution: Literal["fixed", "uniform", "lognormal"]
    value: PositiveInt | None = None
    low: PositiveInt | None = None
    high: PositiveInt | None = None
    median: PositiveFloat | None = None
    sigma: float | None = Field(None, ge=0)

    @model_validator(mode="after")
    def _fields(self) -> OutputLengths:
        needs = {"fixed": ("value",), "uniform": ("low", "high"), "lognormal": ("median", "sigma")}
        missing = [f for f in needs[self.distribution] if getattr(self, f) is None]
        if missing:
            raise ValueError(f"distribution {self.distribution!r} needs {', '.join(missing)}")
        if self.distribution == "uniform" and self.low > self.high:  # type: ignore[operator]
            raise ValueError("low must not exceed high")
        return self


class Profile(Spec):
    name: str
    served_model_name: str = Field(description="What /v1/models lists and requests must name.")
    hardware: Hardware
    model: ModelArch
    serving: Serving
    output_lengths: OutputLengths

    def with_serving(self, **flags: Any) -> Profile:
        """The same profile with some serving flags overridden (the CLI's --max-num-seqs, ...)."""
        serving = Serving.model_validate({**self.serving.model_dump(), **flags})
        return self.model_copy(update={"serving": serving})


def _include(value: Any, kind: str, base: Path) -> Any:
    """A hardware or model given by name is read from `<kind>/<name>.yaml` beside the profile."""
    if not isinstance(value, str):
        return value
    for directory in (base / kind, PROFILE_DIR / kind):
        path = directory / f"{value}.yaml"
        if path.is_file():
            return yaml.safe_load(path.read_text())
    raise FileNotFoundError(
        f"no {kind} file named {value!r} in {base / kind} or {PROFILE_DIR / kind}"
    )


def load_profile(name_or_path: str | Path) -> Profile:
    """Read a profile: a path to a YAML file, or the name of a bundled one (`gemma-3-27b-...`)."""
    path = Path(name_or_path)
    if not path.is_file():
        path = PROFILE_DIR / f"{name_or_path}.yaml"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in PROFILE_DIR.glob("*.yaml")))
        raise FileNotFoundError(f"no profile {name_or_path!r}; bundled: {known}")
    raw = yaml.safe_load(path.read_text())
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: a profile is a mapping")
    raw.setdefault("name", path.stem)
    raw["hardware"] = _include(raw.get("hardware"), "hardware", path.parent)
    raw["model"] = _include(raw.get("model"), "models", path.parent)
    profile = Profile.model_validate(raw)
    cache_geometry(profile)  # refuses, as vLLM would, a cache that cannot hold one request
    return profile


def bundled_profiles() -> list[str]:
    return sorted(p.stem for p in PROFILE_DIR.glob("*.yaml"))


@dataclass(frozen=True, slots=True)
class CacheGeometry:
    """The KV cache as vLLM's block pool sees it, in units of one block of one layer.

    A sequence holds, per global layer, blocks for all its tokens, and per local layer only the
    blocks that still overlap its sliding window (vLLM's sliding-window manager frees the ones
    that fell out of it). Counting in layer-blocks lets the two kinds share one pool.

    `global_layers` and `local_layers` here are vLLM's memory slots, not the model's layer
    counts: its hybrid allocator gives every KV-cache group as many layers as the rarer kind
    has and pads the last group (docs/design/hybrid_kv_cache_manager.md, "Case 3": Gemma 3
    27B's 52 local layers take 6 groups of 10, i.e. 60 slots). Gemma 3 12B's 40 = 5 x 8 fits.
    """

    block_size: int
    global_layers: int
    local_layers: int
    window: int  # 0 when every layer is global
    block_bytes: int  # one block of one layer
    kv_budget_bytes: float
    capacity_units: int

    def units(self, computed: int, end: int) -> int:
        """Layer-blocks a sequence holds once slots up to `end` exist, `computed` of them done.

        The first query of the step sits at position `computed` and its window starts
        `window - 1` tokens earlier; local blocks wholly before that are free again.
        """
        blocks = -(-end // self.block_size)
        if not self.local_layers:
            return self.global_layers * blocks
        first_needed = max(0, computed - self.window + 1)
        local = blocks - first_needed // self.block_size
        return self.global_layers * blocks + self.local_layers * local

    def bytes_per_token(self) -> int:
        """KV bytes one token costs while within every window (for reports)."""
        return (self.global_layers + self.local_layers) * self.block_bytes // self.block_size


def cache_geometry(profile: Profile) -> CacheGeometry:
    """KV capacity = HBM x gpu_memory_utilization - weights - activation reserve (vLLM's rule)."""
    hw, model, serving = profile.hardware, profile.model, profile.serving
    hbm = hw.chips * hw.hbm_bytes_per_chip
    weights = model.total_params * model.dtype_bytes
    budget = hbm * serving.gpu_memory_utilization - weights - serving.activation_reserve_bytes
    block_size = serving.kv_block_size
    block_bytes = block_size * model.kv_bytes_per_layer_token
    units = math.floor(budget / block_bytes) if budget > 0 else 0
    global_slots, local_slots = model.global_layers, model.local_layers
    if global_slots and local_slots:
        group = min(global_slots, local_slots)
        global_slots = -(-global_slots // group) * group
        local_slots = -(-local_slots // group) * group
    geometry = CacheGeometry(
        block_size=block_size,
        global_layers=global_slots,
        local_layers=local_slots,
        window=model.sliding_window or 0,
        block_bytes=block_bytes,
        kv_budget_bytes=budget,
        capacity_units=units,
    )
    # vLLM refuses to start unless one request of max_model_len fits, its largest prefill
    # chunk included; the same rule guarantees the simulated scheduler never deadlocks.
    longest = serving.max_model_len
    worst = geometry.units(max(0, longest - serving.max_num_batched_tokens), longest)
    if units < worst:
        raise ValueError(
            f"profile {profile.name!r}: a {longest}-token request needs {worst * block_bytes / 1e9:.2f}"
            f" GB of KV cache, but only {max(budget, 0) / 1e9:.2f} GB is left after"
            f" {weights / 1e9:.2f} GB of weights; vLLM would refuse to start"
        )
    return geometry
