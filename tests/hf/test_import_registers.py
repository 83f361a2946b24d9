"""`import kvpage` alone makes attn_implementation="kvpage" loadable in transformers (from_config and
from_pretrained), in a fresh interpreter where nothing else of kvpage was touched first, and the model
loaded so runs kvpage's attention (through a PagedCache, matching sdpa)."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import kvpage

PYTHON_DIR = Path(kvpage.__file__).resolve().parent.parent

SCRIPT = textwrap.dedent("""
    import sys
    import kvpage
    assert "torch" not in sys.modules and "transformers" not in sys.modules, "import kvpage stays light"
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    torch.manual_seed(0)
    built = AutoModelForCausalLM.from_config(config, attn_implementation="kvpage").eval()
    built.save_pretrained(sys.argv[1])
    loaded = AutoModelForCausalLM.from_pretrained(sys.argv[1], attn_implementation="kvpage").eval()
    assert built.config._attn_implementation == loaded.config._attn_implementation == "kvpage"
    ids = torch.tensor([[3, 9, 27, 5, 11]])
    with torch.no_grad():
        ours = loaded(ids, cache=kvpage.PagedCache(loaded.config)).logits
        loaded.set_attn_implementation("sdpa")
        torch.testing.assert_close(ours, loaded(ids).logits, rtol=1e-4, atol=1e-4)
    print("ok")
""")


def test_import_kvpage_alone_registers_the_attention(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(PYTHON_DIR)}
    result = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "model")], capture_output=True,
                            text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("ok")
