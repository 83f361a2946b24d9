"""Speculative decoding on the paged KV cache (vLLM's speculative_config): n-gram and draft-model proposals
verified in one target step (a decode with k + 1 query tokens over the paged cache), with lookahead slots in
the block manager and rejected tokens rolled back by the sequence's computed-token count."""
from .config import METHODS, SpeculativeConfig, parse_speculative_config, speculative_config_arg

__all__ = ["METHODS", "SpeculativeConfig", "build_spec_decode", "parse_speculative_config", "speculative_config_arg"]


def build_spec_decode(config, params_of, vocab_size: int, max_model_len, seed: int = 0):
    """The engine's SpecDecode for a (checked) speculative_config, or None without one."""
    config = parse_speculative_config(config)
    if config is None:
        return None
    from .decoder import SpecDecode
    if config.method == "ngram":
        from .decoder import NgramSeqProposer
        proposer = NgramSeqProposer(config)
    else:
        from .draft_model import DraftModelProposer, load_draft_model
        proposer = DraftModelProposer(load_draft_model(config.model, vocab_size))
    return SpecDecode(config, proposer, params_of, max_model_len, seed)
