"""The live speedup over autoregressive decoding, measured fairly: the one function the web app and
the notebook dashboard show.

Rules, each with its reason:
- Decode rate, prefill excluded: tokens committed over the time of the steps (draft + target +
  overhead). Prefill reads the prompt (the target, and the draft where a policy drafts, as a
  serving engine prefills both), a cost per prompt, not per token; and the time a view spends
  drawing between steps is the view's, not the policy's.
- Both warm (`warm_up`): a process's first generation of a policy pays one-off costs (allocations,
  the first int8 packing, `--budget auto`'s profile) that would count against whichever ran first.
- Same prompt, settings and length, `ar` measured right before each live run (`ar_steps`,
  `fresh`): a rate cached from another moment carries that moment's noise into every later ratio,
  where a fresh one shares the run's. It doubles a short run's wait, worth it for a number the
  room reads aloud.
- With its spread: a run's steps differ (a step that accepts 3 tokens is cheap per token, one that
  accepts none is not), so the ratio comes with a bootstrap interval over both runs' steps.
- A running speedup is shown only once MIN_TOKENS tokens are in: after one step it is that step's
  luck, not the policy's speed.
- A baseline that something else slowed is flagged (`busy_text`): a forward of a whole tree never
  costs less than a forward of one token, so where `ar`'s forwards took longer than the run's, the
  cores were shared while `ar` ran (a notebook beside the app, a build) and the ratio overstates.
  The interval over steps cannot show it: every `ar` step was slowed alike. Where this machine's
  latency profile is at hand, `ar`'s forwards are also checked against its t(1), which catches a
  baseline that ran faster than the run could (another thread, a quieter moment) as well.
"""

from __future__ import annotations

import json
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from dyspec.auto.profile import PROFILE_MARGIN
from dyspec.core.events import StepVerified
from dyspec.decode.engine import generate
from dyspec.defaults import defaults_for
from dyspec.load import ModelPair

MIN_TOKENS = 16
BUSY = 1.25  # ar's median forward over the run's beyond which ar was slowed by something else
METHOD = "decode rates, prefill excluded, both warm; ar measured right before the run"
RESAMPLES = 200
WARM_PROMPT = "Tell me about the history of bread."  # a long answer: `AUTO_WARM_TOKENS` of it
WARM_TOKENS = 8
# under auto the cap moves over an answer, and a step on the device compiles its programs for each new cap's shapes
AUTO_WARM_TOKENS = 64


def step_seconds(step: StepVerified) -> float:
    return step.draft_s + step.target_s + step.overhead_s


def decode_rate(steps: Sequence[StepVerified]) -> float:
    """Tokens per second over the steps' own time."""
    return sum(len(s.emitted) for s in steps) / max(sum(step_seconds(s) for s in steps), 1e-9)


@dataclass
class Speedup:
    ratio: float  # the policy's decode rate over ar's
    low: float  # 5th and 95th percentiles of the ratio over bootstrap resamples of both runs' steps
    high: float
    tokens_per_s: float
    ar_tokens_per_s: float

    def __str__(self) -> str:
        return f"{self.ratio:.2f}x (90% interval over steps {self.low:.2f}-{self.high:.2f}x)"


def measured_speedup(steps: Sequence[StepVerified], ar: Sequence[StepVerified], seed: int = 0) -> Speedup | None:
    """The policy's decode rate over `ar`'s on the same prompt; None before both have steps."""
    if not steps or not ar:
        return None
    rng = random.Random(seed)
    ratios = sorted(
        decode_rate(rng.choices(steps, k=len(steps))) / decode_rate(rng.choices(ar, k=len(ar)))
        for _ in range(RESAMPLES)
    )
    rate, ar_rate = decode_rate(steps), decode_rate(ar)
    return Speedup(rate / ar_rate, ratios[RESAMPLES // 20], ratios[-RESAMPLES // 20 - 1], rate, ar_rate)


def speedup_text(
    steps: Sequence[StepVerified], ar: Sequence[StepVerified], final: bool, profile_ms: float | None = None
) -> str:
    """The speedup as the views show it: nothing until MIN_TOKENS tokens are in, the ratio while the
    run streams, and with its interval once it is over (the bootstrap costs more than a step: too
    much to repeat after every step); an unreliable baseline (`busy_text`) says so after it."""
    if sum(len(s.emitted) for s in steps) < MIN_TOKENS:
        return f"waiting for {MIN_TOKENS} tokens"
    shown = str(measured_speedup(steps, ar)) if final else f"{decode_rate(steps) / decode_rate(ar):.2f}x"
    busy = busy_text(steps, ar, profile_ms)
    return f"{shown}. {busy}" if busy else shown


def busy_text(steps: Sequence[StepVerified], ar: Sequence[StepVerified], profile_ms: float | None = None) -> str:
    """A warning where `ar`'s measurement cannot be trusted, "" otherwise: its one-token forwards took
    longer (by their medians) than the run's forwards of whole trees, or, given `profile_ms` (this
    machine's profiled t(1)), longer or shorter than PROFILE_MARGIN times what the profile says."""
    if not steps or not ar:
        return ""
    ar_ms = 1e3 * statistics.median(s.target_s for s in ar)
    run_ms = 1e3 * statistics.median(s.target_s for s in steps)
    if ar_ms > BUSY * run_ms:
        return (
            f"Unreliable: ar's forwards of one token took {ar_ms:.1f} ms, this run's forwards of whole trees "
            f"{run_ms:.1f} ms, so something else used the cores while ar ran and this speedup overstates; "
            "measure again with nothing else running"
        )
    if profile_ms and not 1 / PROFILE_MARGIN <= ar_ms / profile_ms <= PROFILE_MARGIN:
        slower = ar_ms > profile_ms
        return (
            f"Unreliable: ar's forwards of one token took {ar_ms:.1f} ms, this machine's profile says "
            f"{profile_ms:.1f} ms, so ar ran {'slower' if slower else 'faster'} than this machine runs it "
            f"and this speedup {'overstates' if slower else 'may understate'}; measure again with nothing else "
            "running (`dyspec profile` measures the profile again)"
        )
    return ""


def mean_step(steps: Sequence[StepVerified]) -> dict[str, float]:
    """An average step: milliseconds in the target's forward, in the drafts' forwards and in the rest
    (building the tree, verifying, committing), draft forwards, tokens."""
    n = len(steps)
    parts = ("target", "draft", "overhead")
    mean = {f"{part}_ms": 1e3 * sum(getattr(s, f"{part}_s") for s in steps) / n for part in parts}
    mean["draft_forwards"] = sum(s.draft_forwards for s in steps) / n
    return mean | {"tokens": sum(len(s.emitted) for s in steps) / n}


def step_splits(pair: ModelPair, prompt, settings, max_new_tokens: int) -> dict[str, dict[str, float]]:
    """Per (policy, budget) in `settings`, "policy@budget": its average step (`mean_step`) on
    `prompt`, each measured warm."""
    splits = {}
    for policy, budget in settings:
        warm_up(pair, policy, budget, {})
        splits[f"{policy}@{budget}"] = mean_step(steps_of(pair, prompt, policy, budget, max_new_tokens=max_new_tokens))
    return splits


def step_split_text(steps: Sequence[StepVerified], ar: Sequence[StepVerified] = ()) -> str:
    """Where an average step's time went (the target's forward, the drafts' forwards, the rest:
    building the tree, verifying, committing) beside the tokens it made, and `ar`'s step beside it:
    a step pays when its time over its tokens is below ar's time for one."""
    if not steps:
        return ""
    m = mean_step(steps)
    text = (
        f"An average step: {m['target_ms']:.1f} ms in the target's forward + {m['draft_ms']:.1f} ms "
        f"drafting ({m['draft_forwards']:.1f} draft forwards) + {m['overhead_ms']:.1f} ms "
        f"building, verifying and committing, for {m['tokens']:.2f} tokens"
    )
    if ar:
        text += f"; ar's step: {1e3 * sum(map(step_seconds, ar)) / len(ar):.1f} ms for 1 token"
    return text


def running_speedup(steps: Sequence[StepVerified], ar_tokens_per_s: float) -> list[float | None]:
    """Per step, the speedup so far (tokens so far over time so far, over ar's rate), None until
    MIN_TOKENS tokens are in."""
    out, tokens, seconds = [], 0, 0.0
    for s in steps:
        tokens += len(s.emitted)
        seconds += step_seconds(s)
        out.append(tokens / max(seconds, 1e-9) / ar_tokens_per_s if tokens >= MIN_TOKENS else None)
    return out


def warm_up(
    pair: ModelPair, policy: str, budget: int | str, cache: dict, options: dict | None = None, temperature: float = 0.0
) -> None:
    """One short generation of `policy` per pair and `cache` (a dict the caller keeps), so that no
    measured run pays a first run's one-off costs; a policy with `options`, at a `temperature` of
    its own or at budget `auto` once more for those, at that budget (the step on the device's
    programs compile for its shapes: dyspec.core.programs), longer under `auto` (`AUTO_WARM_TOKENS`)."""
    warmed = cache.setdefault("warm", set())
    for name in dict.fromkeys(("ar", policy)):
        if name not in warmed:
            generate(pair, WARM_PROMPT, policy=name, budget=budget, max_new_tokens=WARM_TOKENS)
            warmed.add(name)
    setting = (policy, json.dumps(options or {}, sort_keys=True), budget, temperature)
    if (options or temperature or budget == "auto") and setting not in warmed:
        tokens = AUTO_WARM_TOKENS if budget == "auto" else WARM_TOKENS
        generate(
            pair,
            WARM_PROMPT,
            policy=policy,
            budget=budget,
            max_new_tokens=tokens,
            options=options,
            temperature=temperature,
        )
        warmed.add(setting)


def ar_key(prompt: str, temperature: float, seed: int, max_new_tokens: int) -> tuple:
    """Where `ar_steps` keeps `ar`'s steps for these settings in its cache."""
    return (prompt, temperature, seed, max_new_tokens)


def ar_steps(
    pair: ModelPair, prompt: str, temperature: float, seed: int, max_new_tokens: int, cache: dict, fresh: bool = False
) -> list[StepVerified]:
    """`ar`'s steps on this prompt and settings, measured warm, once per `cache` (a dict the caller
    keeps: the app and the dashboard keep one per model pair), or with `fresh` now, for a run about
    to be measured (the cache then holds the latest)."""
    key = ar_key(prompt, temperature, seed, max_new_tokens)
    if fresh or key not in cache:
        warm_up(pair, "ar", 1, cache)
        cache[key] = steps_of(pair, prompt, "ar", 1, temperature=temperature, seed=seed, max_new_tokens=max_new_tokens)
    return cache[key]


def steps_of(pair: ModelPair, prompt: str, policy: str, budget: int | str, **kwargs) -> list[StepVerified]:
    """The steps of one generation (`generate`'s keyword arguments)."""
    steps: list[StepVerified] = []
    hook = lambda e: steps.append(e) if isinstance(e, StepVerified) else None  # noqa: E731
    generate(pair, prompt, policy=policy, budget=budget, hooks=[hook], **kwargs)
    return steps


def default_step_text(pair: ModelPair, prompt: str, max_new_tokens: int = 64) -> str:
    """Where a step of the device's default policy went on `prompt`, beside ar's step, both warm."""
    default = defaults_for(pair.device, pair.int8_kernel)
    warm_up(pair, default.policy, default.budget, {})
    ar = steps_of(pair, prompt, "ar", 1, max_new_tokens=max_new_tokens)
    steps = steps_of(
        pair, prompt, default.policy, default.budget, max_new_tokens=max_new_tokens, options=default.options
    )
    return f"{default.text} (the default here): {step_split_text(steps, ar)}"
