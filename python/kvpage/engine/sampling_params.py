"""SamplingParams: how one request picks its tokens and when it stops (vLLM's names and defaults)."""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Sequence


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# The largest finite float32: logits are float32, so a bias beyond it becomes inf there.
_FLOAT32_MAX = 3.4028234663852886e38
# The smallest normal float32: a penalty below it is 0 or subnormal there (1 / it overflows).
_FLOAT32_TINY = 1.1754943508222875e-38

# torch.Generator.manual_seed's range: [-2**63, 2**64).
SEED_MIN, SEED_END = -2**63, 2**64

# Containers a list of stops may come in (order never matters: the earliest match wins).
_COLLECTIONS = (list, tuple, set, frozenset)


def check_encodable(text: str, name: str) -> None:
    """ValueError naming `name` for text a tokenizer cannot take (a lone surrogate is not UTF-8)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{name} cannot be encoded as UTF-8: {e.reason} at index {e.start}"
                         f" ({text[e.start:e.end]!r})") from None


def check_seed(seed, name: str = "seed") -> None:
    """An int in the range torch.Generator.manual_seed takes, rather than one silently taken mod 2**64."""
    if not _is_int(seed) or not SEED_MIN <= seed < SEED_END:
        raise ValueError(f"{name} must be an int in [-2**63, 2**64), got {seed!r}")


def _strings(name: str, value) -> list[str]:
    """stop / bad_words: None, a string or a collection of them, as a list; ValueError naming `name`."""
    if value is None:
        return []
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, _COLLECTIONS) or not all(isinstance(s, str) and s for s in items):
        raise ValueError(f"{name} must be None, a non-empty string or a list of them, got {value!r}")
    for i, item in enumerate(items):
        check_encodable(item, f"{name}[{i}]")
    return list(items)


def _logit_bias(bias) -> dict[int, float] | None:
    if bias is None:
        return None
    # Finite in float32, where the logits live: a bias that rounds to inf would turn inf - inf into nan.
    if not isinstance(bias, dict) or not all(_is_int(t) and t >= 0 and _is_number(b) and abs(b) <= _FLOAT32_MAX
                                             for t, b in bias.items()):
        raise ValueError(f"logit_bias must be None or a dict of non-negative int token ids to numbers finite in"
                         f" float32, got {bias!r}")
    return {t: float(b) for t, b in bias.items()}


def _allowed_token_ids(ids) -> list[int] | None:
    if ids is None:
        return None
    if not isinstance(ids, _COLLECTIONS) or not ids or not all(_is_int(t) and t >= 0 for t in ids):
        raise ValueError(f"allowed_token_ids must be None or a non-empty list of non-negative ints, got {ids!r}")
    return sorted(set(ids))


def _stop_token_ids(ids) -> list[int]:
    if ids is None:
        return []
    if not isinstance(ids, _COLLECTIONS) or not all(_is_int(t) and t >= 0 for t in ids):
        raise ValueError(f"stop_token_ids must be None or a list of non-negative ints, got {ids!r}")
    return list(ids)


@dataclass
class SamplingParams:
    """temperature=0 is greedy; top_k=0 (or -1) and top_p=1 disable those filters.

    seed: a per-request generator, so the same seed gives the same tokens whatever else shares the
    batch. beam_width > 1 runs beam search (deterministic, as HF generate(num_beams=beam_width,
    do_sample=False)); temperature, top-k/p, seed and n are ignored, and the beam_width best beams
    are returned, best first.

    vLLM's logits options, with vLLM's defaults (engine/sampler.py gives the order they apply in):
    repetition_penalty (> 0, over prompt and output tokens: a seen token's logit is divided by it
    where positive, multiplied where negative, as HF's RepetitionPenaltyLogitsProcessor);
    presence_penalty / frequency_penalty (in [-2, 2], over output tokens: logit -= presence *
    (count > 0) + frequency * count); min_p (in [0, 1]: after temperature and before top-k / top-p,
    drop tokens less likely than min_p times the most likely one); min_tokens (<= max_tokens: until
    that many output tokens exist, eos and stop_token_ids cannot be sampled and stop strings end
    nothing); logprobs (None, or k >= 0: each CompletionOutput gets one {token_id: Logprob} dict per
    output token, the sampled token and the k most likely, from the model's log-softmax before
    penalties, temperature and filters: the distribution cumulative_logprob sums); logit_bias ({token
    id: bias} added to those logits) and allowed_token_ids (every other token gets -inf), first of all
    the processors, as vLLM applies them; bad_words (vLLM's rule: a word's last token is banned
    wherever its other tokens end the output so far; each word as tokenized alone and after a
    space); prompt_logprobs
    (None, or k >= 0: RequestOutput.prompt_logprobs gets None for the first prompt token, then for each
    later one a dict of that token and the k most likely at its position; as in vLLM, such a prompt is
    computed whole, not read from the prefix cache); include_stop_str_in_output (keep the matched
    stop string in the text); skip_special_tokens (leave eos and the like out of the text);
    truncate_prompt_tokens (None, or k >= 1: only the prompt's last k tokens are used). Beam search
    takes none of the penalties, min_p, min_tokens, logprobs, prompt_logprobs, logit_bias,
    allowed_token_ids or bad_words (ValueError naming the field).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int = 16
    stop: str | Sequence[str] | None = None
    stop_token_ids: Sequence[int] | None = None
    ignore_eos: bool = False
    beam_width: int = 1
    length_penalty: float = 1.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_p: float = 0.0
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    bad_words: str | Sequence[str] | None = None
    allowed_token_ids: Sequence[int] | None = None
    skip_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check every field (ValueError naming it) and normalise stop / stop_token_ids to lists.

        A dataclass does not re-check fields assigned after construction, so add_request calls this
        again: a mutated SamplingParams is rejected before anything runs.
        """
        self._check_ints()
        self._check_floats()
        self._check_logits_options()
        self.stop = _strings("stop", self.stop)
        self.bad_words = _strings("bad_words", self.bad_words)
        self.stop_token_ids = _stop_token_ids(self.stop_token_ids)
        self.logit_bias = _logit_bias(self.logit_bias)
        self.allowed_token_ids = _allowed_token_ids(self.allowed_token_ids)
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.use_beam_search:
            self._check_beam_options()

    def clone(self) -> SamplingParams:
        """A checked copy with containers of its own (validate() rebuilds every list and dict), which
        add_request keeps: the caller may change or reuse its object, from another thread too, without
        reaching a request in flight."""
        copied = copy.copy(self)
        copied.validate()
        return copied

    def _check_ints(self) -> None:
        for name, low in (("n", 1), ("max_tokens", 1), ("beam_width", 1)):
            value = getattr(self, name)
            if not _is_int(value) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be an int: 0 or -1 (disabled) or >= 1, got {self.top_k!r}")
        if self.seed is not None:
            check_seed(self.seed)
        if self.truncate_prompt_tokens is not None and (not _is_int(self.truncate_prompt_tokens)
                                                        or self.truncate_prompt_tokens < 1):
            raise ValueError(f"truncate_prompt_tokens must be None or an int >= 1, got {self.truncate_prompt_tokens!r}")

    def _check_floats(self) -> None:
        if not _is_number(self.temperature) or not 0.0 <= self.temperature < float("inf"):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        # Any finite value works (beam_search normalises in log space where a power would overflow).
        if not _is_number(self.length_penalty) or not math.isfinite(self.length_penalty):
            raise ValueError(f"length_penalty must be a finite number, got {self.length_penalty!r}")

    def _check_logits_options(self) -> None:
        """vLLM's ranges. repetition_penalty (> 0) must also be a normal float32, where the logits live:
        1e300 there is inf and 1e-300 is 0, which would turn seen logits into inf, -inf or nan."""
        if not _is_number(self.repetition_penalty) or not _FLOAT32_TINY <= self.repetition_penalty <= _FLOAT32_MAX:
            raise ValueError(f"repetition_penalty must be a number > 0 within float32's normal range"
                             f" [{_FLOAT32_TINY:.4g}, {_FLOAT32_MAX:.4g}], got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be a number in [-2, 2], got {value!r}")
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an int >= 0, got {self.min_tokens!r}")
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens={self.min_tokens} must be <= max_tokens={self.max_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < 0):
                raise ValueError(f"{name} must be None or an int >= 0, got {value!r}")

    def _check_beam_options(self) -> None:
        """Beam search ranks beams by the model's own log-probabilities (HF's arithmetic, token for
        token); these options would change what it ranks, so they are refused rather than ignored."""
        for name, default in (("repetition_penalty", 1.0), ("presence_penalty", 0.0), ("frequency_penalty", 0.0),
                              ("min_p", 0.0), ("min_tokens", 0), ("logprobs", None),
                              ("prompt_logprobs", None), ("logit_bias", None), ("allowed_token_ids", None),
                              ("bad_words", [])):
            if getattr(self, name) != default:
                raise ValueError(f"{name}={getattr(self, name)!r} is not supported with beam search"
                                 f" (beam_width={self.beam_width}); leave it at {default!r}")
        if self.stop:  # beams end on token ids only: a stop string would be silently ignored
            raise ValueError(f"stop={self.stop!r} is not supported with beam search (beam_width={self.beam_width});"
                             f" use stop_token_ids")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.beam_width > 1

    @property
    def use_beam_search(self) -> bool:
        return self.beam_width > 1

    @property
    def uses_penalties(self) -> bool:
        """Any of the penalties that read the request's tokens (engine/logits_processors.py)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def uses_token_bias(self) -> bool:
        """logit_bias or allowed_token_ids: fixed changes to some tokens' logits, whatever the history."""
        return self.logit_bias is not None or self.allowed_token_ids is not None

    @property
    def needs_filter(self) -> bool:
        """top-k or top-p cuts the distribution (a sort over the vocabulary)."""
        return not self.greedy and (self.top_k > 0 or self.top_p < 1.0)
