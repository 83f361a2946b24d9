"""The parallelism flags of generate / chat / demo / bench reach kvpage.LLM: tensor parallelism answers
as one process does (greedy), and a decode-context-parallel size the model cannot take is refused by
LLM's own check, named, in one line."""
import subprocess
import sys


def _generate(model_dir, *flags) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvpage", "generate", "--model", str(model_dir), *flags,
                           "--max-tokens", "6", "--temperature", "0", "--raw", "Hello there"],
                          capture_output=True, text=True, timeout=300)


def test_tensor_parallel_generate_answers_as_one_process(tiny_model_dir):
    single, parallel = _generate(tiny_model_dir), _generate(tiny_model_dir, "--tensor-parallel-size", "2")
    assert single.returncode == 0, single.stderr[-2000:]
    assert parallel.returncode == 0, parallel.stderr[-2000:]
    assert parallel.stdout == single.stdout and single.stdout.strip()


def test_decode_context_parallel_size_reaches_the_llm(tiny_model_dir):
    # The tiny model has 2 KV heads: at TP=2 each rank holds its own, so no rank can share one.
    run = _generate(tiny_model_dir, "--tensor-parallel-size", "2", "--decode-context-parallel-size", "2")
    assert run.returncode != 0
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("kvpage generate: error:") and "decode_context_parallel_size" in last, run.stderr[-2000:]
