"""Config sections of rollouts: how tokens are sampled (`sampling:`) and where the sampler
computes (`rollout:`).

Defaults are the GRPO100 recipe's (../shared/specs/grpo.md): temperature 1.0, top-p 1.0, no top-k,
2,048 new tokens per turn, 32,768 tokens per episode, groups of 8 episodes, one group per
update; the rollout layout is chosen automatically (docs/rollout.md "Layouts").
"""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, BeforeValidator, Field, model_validator

from jscenegen.config import TOKENS_MAX, Section
from jscenegen.generate.sampler import DEFAULT_BUCKETS, check_buckets
from jscenegen.generate.sampling import MIN_TEMPERATURE, SamplingParams
from jscenegen.sharding.rules import round_up

GROUP_MAX = 4096       # episodes of one scene per batch: far beyond any GRPO recipe (VERL n <= 64)


def _no_empty_string(value: tuple[str, ...]) -> tuple[str, ...]:
    if any(not s for s in value):
        raise ValueError("stop_strings must not contain an empty string (it would end every turn)")
    return value


StopStrings = Annotated[tuple[str, ...], AfterValidator(_no_empty_string)]
"""Stop strings of the rollouts (`sampling.stop_strings`) and of the SFT demonstrations that
must match them (`sft.stop_strings`): texts, none empty."""
DEFAULT_STOP_STRINGS = ("</action>",)
# the sampling filters greedy decoding needs off (`sampling.greedy`; `--greedy` sets them)
GREEDY_OFF = {"top_k": 0, "top_p": 1.0}


def _verl_off(value):
    """top_k: -1 (VERL's and vLLM's "off") is 0, this config's; other values as given."""
    return 0 if type(value) is int and value == -1 else value


class SamplingConfig(Section):
    """How rollouts sample: the distribution, the stops, the caps and the compiled shapes."""

    temperature: float = Field(1.0, ge=MIN_TEMPERATURE, description="logits are divided by it; "
                               "the rollout log-probs and the trainer's recompute use the same "
                               "value (greedy: true for argmax)")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus mass; 1.0 = off")
    top_k: Annotated[int, BeforeValidator(_verl_off)] = Field(
        0, ge=0, description="keep the k most likely tokens; 0 = off (-1, VERL's and vLLM's "
        "spelling of off, is read as 0); of logits tied at the k-th value the lowest token ids "
        "are kept")
    greedy: bool = Field(False, description="argmax instead of sampling (evaluation); top_k must "
                         "then be 0 and top_p 1.0, or the config is refused naming the values and "
                         "who set them (configs/cpu-default.yaml sets top_p 0.9: give "
                         "sampling.top_p=1.0 with sampling.greedy=true, or --greedy where the "
                         "command has it, which sets all three)")
    max_new_tokens: int = Field(2048, ge=1, le=TOKENS_MAX,
                                description="tokens one assistant turn may generate (at most "
                                "max_episode_tokens)")
    max_episode_tokens: int = Field(32768, ge=16, le=TOKENS_MAX,
                                    description="context cap of one episode (prompt, every turn "
                                    "and every environment message)")
    stop_strings: StopStrings = Field(
        DEFAULT_STOP_STRINGS, description="a turn also ends when its text contains one of these; the "
        "end-of-turn token is then appended as environment (mask 0)")
    buckets: tuple[int, ...] = Field(DEFAULT_BUCKETS, description="append chunk lengths "
                                     "(compiled shapes), increasing, each a multiple of the "
                                     "smallest")
    cache_tokens: int | None = Field(None, gt=0, le=3 * TOKENS_MAX,
                                     description="KV-cache slots per row, fixed; null: the cache "
                                     "starts at the prompt plus one decode segment (the smallest "
                                     "bucket) and grows (doubling) up to max_episode_tokens + "
                                     "max_new_tokens, rounded up to the smallest bucket, plus "
                                     "one bucket")
    chat_template_path: str | None = Field(None, description="replacement chat template (jinja); "
                                           "null = the model directory's own")

    @model_validator(mode="after")
    def _check(self):
        b = check_buckets(self.buckets)
        if b[-1] > TOKENS_MAX:
            raise ValueError(f"buckets must be lengths up to {TOKENS_MAX}, got {list(b)}")
        if self.greedy and (self.top_k or self.top_p < 1):   # SamplingParams' rule, with the fix
            on = [k for k, off in GREEDY_OFF.items() if getattr(self, k) != off]
            raise ValueError(f"sampling.greedy takes the argmax, so top_k and top_p must be off, "
                             f"but {' and '.join(f'sampling.{k} is {getattr(self, k)}' for k in on)}: set "
                             f"{' and '.join(f'sampling.{k}={GREEDY_OFF[k]}' for k in on)} too (--greedy, on "
                             "the commands that have it, sets all three)")
        self.params()   # the sampling rules
        if self.max_new_tokens > self.max_episode_tokens:
            # the cache is sized for an episode plus a turn: a turn longer than any episode can
            # hold only inflates it (a fixed-size Qwen3.5 cache by the whole difference)
            raise ValueError(f"max_new_tokens {self.max_new_tokens} exceeds max_episode_tokens "
                             f"{self.max_episode_tokens}: a turn cannot outgrow its episode")
        need = self.max_episode_tokens + self.max_new_tokens + b[0]
        if self.cache_tokens is not None and self.cache_tokens < need:
            raise ValueError(f"cache_tokens {self.cache_tokens} must be at least max_episode_tokens "
                             f"+ max_new_tokens + the smallest bucket = {need}")
        return self

    def params(self) -> SamplingParams:
        """The sampler's SamplingParams."""
        return SamplingParams(self.temperature, self.top_p, self.top_k, self.greedy)

    def cache_slots(self) -> int:
        """The most KV-cache slots a row gets (see `cache_tokens`)."""
        if self.cache_tokens is not None:
            return self.cache_tokens
        step = self.buckets[0]
        return round_up(self.max_episode_tokens + self.max_new_tokens, step) + step


class RolloutConfig(Section):
    """Where the sampler computes (sharding/rollout.py) and how many groups share a batch."""

    layout: Literal["auto", "replicated", "tp", "fsdp"] = Field(
        "auto", description="replicated: weights whole on every device, rows over all devices; "
        "tp: tensor-parallel over rollout.tp devices, rows over the rest; fsdp: decode on the "
        "training shards (all-gathers every layer per token; for comparison); auto: replicated "
        "when the weights fit memory_fraction of a device, else tp")
    tp: int | None = Field(None, ge=1, description="tensor-parallel size of the tp layout; "
                           "null: the smallest that fits and divides the heads")
    memory_fraction: float = Field(0.25, gt=0, le=1, description="share of one device's memory "
                                   "the replicated rollout weights may take (auto)")
    dtype: Literal["float32", "bfloat16"] | None = Field(
        None, description="dtype of the rollout weights the model reads in the compute dtype "
        "(matmul and embedding weights; norm weights and Qwen3.5's A_log, dt_bias and conv1d keep "
        "their own); null: model.compute_dtype (what the train step computes with, so the "
        "recomputed log-probs match)")
    groups_per_batch: int = Field(1, ge=1, description="groups (scenes) rolled out together in "
                                  "one batch and trained in one optimizer step; the recipe: 1")
    max_failed_updates: int = Field(
        3, ge=0, description="train stops (with a checkpoint, exit 2) after this many updates in "
        "a row in which every episode failed in our own runtime or sampler (rollout_error, "
        "runtime_error: masked, not the policy's fault); 0: never")

    def sampler_options(self) -> dict:
        """Keyword arguments of `generate.sampler.Sampler` for this section."""
        return dict(layout=self.layout, tp=self.tp, memory_fraction=self.memory_fraction,
                    dtype=self.dtype)
