"""Request intake for LLMEngine: prompts tokenized and checked, a request's options validated, and its
engine-side state registered with the scheduler's request, all or nothing (vLLM's add_request checks)."""
from __future__ import annotations

from kvpage.core.interrupts import deferred_interrupts

from .beam_search import new_beam_search
from .detokenizer import IncrementalDetokenizer
from .logits_processors import bad_words_token_ids, check_some_token_sampleable
from .request_state import RequestState, SampleState
from .sampling_params import SamplingParams, check_encodable


def cache_salt_keys(cache_salt: str | None) -> tuple:
    """The block-hash extra keys of a cache salt (kvpage.core.hashing): () without one."""
    if cache_salt is None:
        return ()
    if not isinstance(cache_salt, str) or not cache_salt:
        raise ValueError(f"cache_salt must be None or a non-empty string, got {cache_salt!r}")
    return ("cache_salt", cache_salt)


class RequestIntake:
    """LLMEngine's add_request and the checks before it (a mixin: state lives on the engine)."""

    def add_request(self, request_id: str, prompt: str | list[int] | None, params: SamplingParams | None = None,
                    *, prompt_token_ids: list[int] | None = None, stream: bool = True,
                    cache_salt: str | None = None) -> None:
        """Queue a request. Raises ValueError (and queues nothing) if it can never run: a prompt longer
        than max_model_len, too long for the whole KV cache, or min_tokens with nothing but stop tokens
        to sample, as vLLM's add_request does (an output reaching max_model_len stops there, "length").
        stream=False: step() reports it only once finished, and its text is decoded once at the end.
        A beam request (beam_width > 1) is scheduled with the others and reported once finished.
        cache_salt (vLLM's): the request shares prefix-cache blocks only with requests of the same salt."""
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        params = params.clone()  # checked again (fields may have been assigned), and the caller's may change now
        stream = stream and not params.use_beam_search  # the best beams are known only at the end
        text, token_ids = self.request_prompt(prompt, prompt_token_ids, params)
        eos, *more_eos = self.config.eos_token_ids or (None,)
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(more_eos))
        # What min_tokens holds back: eos (unless ignore_eos) and every other stop token id.
        held_back = stop_ids | ({eos} if eos is not None and not params.ignore_eos else set())
        if params.min_tokens:
            self._check_min_tokens_reachable(params, held_back)
        self._check_logprobs(params)
        # n (or beam_width) sample records are built next: what the scheduler would refuse is refused first.
        self.scheduler.check_fits(request_id, len(token_ids), params.max_tokens, max(params.n, params.beam_width))
        extra_keys = cache_salt_keys(cache_salt)
        # Everything that can fail is done before the scheduler hears of the request (admission is
        # all-or-nothing); the two registrations then happen together, Ctrl-C deferred.
        state = self._new_state(text, token_ids, params, stream, held_back)
        check_some_token_sampleable(params, state.bad_words_token_ids, self.runner.vocab_size)
        if params.use_beam_search:
            state.beam = new_beam_search(params, len(token_ids), self.config.max_model_len, self.config.eos_token_ids)
        with deferred_interrupts():
            state.request = self.scheduler.add_request(
                request_id, token_ids, max_tokens=params.max_tokens, n=params.n, eos_token_id=eos,
                stop_token_ids=stop_ids, ignore_eos=params.ignore_eos,
                prompt_logits=params.prompt_logprobs is not None, extra_keys=extra_keys,
                beam_width=params.beam_width)
            state.index_of = {state.request.seqs[0].seq_id: 0}
            self._states[request_id] = state
            self.num_prompt_tokens += len(token_ids)

    def _new_state(self, text: str | None, token_ids: list[int], params: SamplingParams, stream: bool,
                   held_back: set[int]) -> RequestState:
        """A request's engine-side state, its scheduler request still to be attached."""
        state = RequestState(None, text, params, stream, [SampleState() for _ in range(params.n)], {})
        if params.prompt_logprobs is not None:
            state.prompt_logprobs = [None]
        if params.bad_words:
            state.bad_words_token_ids = bad_words_token_ids(self.tokenizer, params.bad_words)
        if params.min_tokens:
            state.stop_ids = tuple(sorted(held_back))
        for sample in state.samples:
            if state.needs_detok:
                sample.detok = IncrementalDetokenizer(len(token_ids), params.skip_special_tokens)
            if params.logprobs is not None:
                sample.logprobs = []
        return state

    def _check_logprobs(self, params: SamplingParams) -> None:
        """vLLM's max_logprobs: more than that many alternatives per token is refused, not computed."""
        cap = self.config.max_logprobs if self.config.max_logprobs >= 0 else self.runner.vocab_size
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            if k is not None and k > cap:
                raise ValueError(f"{name}={k} exceeds max_logprobs={cap} (the most log-probabilities per token"
                                 " this engine returns; LLM(max_logprobs=...) raises it)")

    def request_prompt(self, prompt, prompt_token_ids: list[int] | None,
                       params: SamplingParams) -> tuple[str | None, list[int]]:
        """A request's (text, token ids): tokenized and checked, with its params' token ids checked
        against the vocabulary, and truncate_prompt_tokens applied (vLLM's left truncation)."""
        text, token_ids = self.tokenize_prompt(prompt, prompt_token_ids)
        self._check_token_options(params)
        if params.truncate_prompt_tokens is not None:
            token_ids = token_ids[-params.truncate_prompt_tokens:]
        return text, token_ids

    def _check_min_tokens_reachable(self, params: SamplingParams, stop_ids: set[int]) -> None:
        """min_tokens holds back every stop token; where nothing else may be sampled (allowed_token_ids,
        or the whole vocabulary, all stop tokens) no token could come out at all."""
        candidates = params.allowed_token_ids if params.allowed_token_ids is not None else range(self.runner.vocab_size)
        if all(t in stop_ids for t in candidates):
            raise ValueError(f"min_tokens={params.min_tokens}: every token the request may sample"
                             f" ({'allowed_token_ids' if params.allowed_token_ids is not None else 'the vocabulary'})"
                             f" is a stop token, which min_tokens holds back")

    def _check_token_options(self, params: SamplingParams) -> None:
        """Token ids the options name must lie in the vocabulary (an index past it would fail mid-step);
        bad_words need a tokenizer to become token ids."""
        if params.bad_words and self.tokenizer is None:
            raise ValueError("bad_words needs a tokenizer; this model has none (use logit_bias to ban token ids)")
        vocab = self.runner.vocab_size
        for name in ("logit_bias", "allowed_token_ids"):
            ids = getattr(params, name)
            if ids and max(ids) >= vocab:
                raise ValueError(f"{name} names token id {max(ids)}, outside the vocabulary (vocab_size={vocab})")

    def tokenize_prompt(self, prompt, prompt_token_ids: list[int] | None = None) -> tuple[str | None, list[int]]:
        """(text, checked token ids); with prompt_token_ids (already tokenised: chat templates) the prompt
        is just the text."""
        if prompt_token_ids is None:
            return self.tokenize(prompt)
        return prompt, self.tokenize(list(prompt_token_ids))[1]

    def tokenize(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass prompts as lists of token ids")
            check_encodable(prompt, "prompt")
            text, token_ids = prompt, list(self.tokenizer.encode(prompt))
        else:
            text, token_ids = None, list(prompt) if isinstance(prompt, (list, tuple)) else []
            if not token_ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in token_ids):
                raise ValueError("prompt must be a string or a non-empty list of int token ids")
        vocab = self.runner.vocab_size
        if token_ids and (min(token_ids) < 0 or max(token_ids) >= vocab):
            got = f"{min(token_ids)}..{max(token_ids)}"
            if text is not None:  # an index past the embedding would fail mid-step (on CUDA: a device assert)
                raise ValueError(f"the tokenizer gives this prompt token ids {got}, outside the model's vocabulary"
                                 f" [0, vocab_size={vocab}): is it another model's tokenizer?")
            raise ValueError(f"prompt token ids must lie in [0, vocab_size={vocab}), got {got}")
        return text, token_ids
