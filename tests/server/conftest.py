"""One tiny-Llama server for the module's tests, and an offline LLM over the same weights to compare with."""
from __future__ import annotations

import pytest

from server_helpers import make_llm, running_server, tiny_llama, tokenizer


@pytest.fixture(scope="session")
def tok():
    return tokenizer()


@pytest.fixture(scope="session")
def model(tok):
    return tiny_llama(len(tok))


@pytest.fixture(scope="session")
def offline(model, tok):
    return make_llm(model, tok)


@pytest.fixture(scope="module")
def server(model, tok):
    """(base URL, app) of a server with room for 64 long streams at once."""
    llm = make_llm(model, tok, num_kv_blocks=2048)
    with running_server(llm) as running:
        yield running
    llm.shutdown()
