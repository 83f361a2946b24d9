"""The range checks (kvpage.ops.config): by default on for CPU tensors (no sync there) and off for GPU tensors
(a device sync per op); KVPAGE_RANGE_CHECKS=1 / 0 turns them on / off everywhere (the test suite runs with
them on). On, an out-of-range index is an exception naming the argument; off, no op runs a range check (the
extension counts them), so no index tensor is read on the host. Bad indices are only ever passed with the
checks on, so no kernel here reads out of bounds."""
import os
import subprocess
import sys

import pytest
import torch

from kvpage import ops
from kvpage.ops import config
from kvpage.ops.config import range_checks_run
from paged_data import int32
from test_bad_inputs import cache_write_args, copy_args, decode_args, prefill_args, swap_args


def test_range_checks_toggle_and_restore():
    assert ops.range_checks_enabled()  # as the suite runs (tests/conftest.py)
    assert ops.set_range_checks(False) is True
    assert not ops.range_checks_enabled()
    assert ops.set_range_checks(True) is False
    with ops.range_checks(False):
        assert not ops.range_checks_enabled()
        with ops.range_checks(True):
            assert ops.range_checks_enabled()
        assert not ops.range_checks_enabled()
    assert ops.range_checks_enabled()
    with pytest.raises(RuntimeError, match="inside"):
        with ops.range_checks(False):
            raise RuntimeError("inside")
    assert ops.range_checks_enabled()


def test_the_default_is_per_device_and_the_environment_variable_sets_it_everywhere():
    """A fresh process each: the variable is read once, at import. The default keys on is_cuda, so a
    stand-in with is_cuda plays a GPU tensor here."""
    code = ("import torch; from kvpage.ops import config; gpu = type('T', (), {'is_cuda': True})();"
            " print(config.range_checks_enabled(torch.zeros(1)), config.range_checks_enabled(gpu))")
    env = {k: v for k, v in os.environ.items() if k != config.RANGE_CHECKS_ENV}

    def run(**extra):
        return subprocess.run([sys.executable, "-c", code], env={**env, **extra}, capture_output=True, text=True)

    assert run().stdout.split() == ["True", "False"]
    assert run(KVPAGE_RANGE_CHECKS="1").stdout.split() == ["True", "True"]
    assert run(KVPAGE_RANGE_CHECKS="0").stdout.split() == ["False", "False"]
    bad = run(KVPAGE_RANGE_CHECKS="maybe")
    assert bad.returncode != 0 and "KVPAGE_RANGE_CHECKS must be 1 or 0" in bad.stderr


@pytest.mark.parametrize("value,enabled", [("1", True), ("true", True), ("ON", True), ("0", False), ("", False),
                                           ("false", False), (" off ", False)])
def test_the_environment_variable_reads_as_vllm_flags_do(monkeypatch, value, enabled):
    monkeypatch.setenv(config.RANGE_CHECKS_ENV, value)
    assert config._env_flag(config.RANGE_CHECKS_ENV) is enabled


def _decoder_layer_args():
    """llama_decoder_layer (the CPU engine's whole layer in one op) over decode_args' cache: 2 tokens."""
    a = decode_args()
    hidden, heads, kv_heads, d, inter = 64, 4, 2, 64, 32
    gen = torch.Generator().manual_seed(7)

    def w(*shape):
        return torch.randn(*shape, generator=gen) * 0.1

    def packed(out_features, in_features):
        slab = torch.empty(ops.layers.packed_linear_shape(out_features, in_features))
        torch.ops.kvpage.pack_linear_weight(slab, w(out_features, in_features))
        return slab

    weights = [torch.ones(hidden), packed((heads + 2 * kv_heads) * d, hidden), packed(hidden, heads * d),
               torch.ones(hidden), packed(2 * inter, hidden), packed(hidden, inter)]
    return dict(hidden=w(2, hidden), weights=weights, biases=[None] * 4,
                widths=[heads * d, kv_heads * d, kv_heads * d, d, inter], epsilons=[1e-6, 1e-6], scale=d ** -0.5,
                cos=torch.ones(2, d), sin=torch.zeros(2, d), key_cache=a["key_cache"], value_cache=a["value_cache"],
                slot_mapping=torch.tensor([39, 48]), block_tables=a["block_tables"], seq_lens=a["seq_lens"],
                query_start_loc=int32([0, 1, 2]), max_query_len=1)


def _decoder_layer(check_ranges, **args):
    return torch.ops.kvpage.llama_decoder_layer(**args, check_ranges=check_ranges)


# (name, valid arguments, call with the switch as Python sets it): every op that takes index tensors.
OPS = [
    ("paged_attention", decode_args, lambda on, **a: ops.paged_attention(**a)),
    ("paged_prefill_attention", prefill_args, lambda on, **a: ops.paged_prefill_attention(**a)),
    ("reshape_and_cache", cache_write_args, lambda on, **a: ops.reshape_and_cache(**a)),
    ("copy_blocks", copy_args, lambda on, **a: ops.copy_blocks(**a)),
    ("swap_blocks", swap_args, lambda on, **a: ops.swap_blocks(**a)),
    ("llama_decoder_layer", _decoder_layer_args, _decoder_layer),
]


@pytest.mark.parametrize("name,make_args,call", OPS, ids=[o[0] for o in OPS])
def test_with_the_switch_off_no_range_check_runs(name, make_args, call):
    if name == "llama_decoder_layer" and ops.cpu_isa() == "generic":
        pytest.skip("the slab GEMM (AVX-512 / AVX2) packs no weights on the generic ISA")
    with ops.range_checks(False):
        before = range_checks_run()
        call(False, **make_args())
        assert range_checks_run() == before
    call(True, **make_args())
    assert range_checks_run() > before


# Out-of-range indices, one argument changed from the valid call: the message names it.
OUT_OF_RANGE = [
    ("paged_attention", decode_args, dict(block_tables=int32([[0, 1, 6], [3, 3, 5]])), r"block_tables\[0, 2\] = 6"),
    ("paged_attention", decode_args, dict(block_tables=int32([[0, 1, 2], [-1, 3, 5]])), r"block_tables\[1, 0\] = -1"),
    ("paged_attention", decode_args, dict(seq_lens=int32([40, 49])), r"seq_lens\[1\] = 49"),
    ("paged_attention", decode_args, dict(seq_lens=int32([0, 17])), r"seq_lens\[0\] = 0"),
    ("paged_prefill_attention", prefill_args, dict(query_start_loc=int32([0, 3, 2, 5])), "query_start_loc"),
    ("paged_prefill_attention", prefill_args, dict(seq_lens=int32([8, 16, 49])), r"seq_lens\[2\] = 49"),
    ("reshape_and_cache", cache_write_args, dict(slot_mapping=torch.tensor([0, 17, -1, 96])),
     r"slot_mapping\[3\] = 96"),
    ("reshape_and_cache", cache_write_args, dict(slot_mapping=torch.tensor([0, 17, 17, 95])),
     r"slot_mapping\[1\] and slot_mapping\[2\] both write slot 17"),
    ("copy_blocks", copy_args, dict(block_mapping=torch.tensor([[0, 1], [6, 2]])), r"block_mapping\[1\] source"),
    ("swap_blocks", swap_args, dict(block_mapping=torch.tensor([[0, 1], [0, 6]])), r"block_mapping\[1\] destination"),
]


@pytest.mark.parametrize("name,make_args,changes,match", OUT_OF_RANGE, ids=[f"{o[0]}-{o[3]}" for o in OUT_OF_RANGE])
def test_with_the_switch_on_an_out_of_range_index_is_named(name, make_args, changes, match):
    before = range_checks_run()
    with pytest.raises(ValueError, match=match):
        getattr(ops, name)(**{**make_args(), **changes})
    assert range_checks_run() > before


def test_by_default_a_cpu_op_still_names_an_out_of_range_index():
    """The public ops' promise (design.md): bad input never reads out of bounds, with no setting made."""
    name, make_args, changes, match = OUT_OF_RANGE[0]
    with ops.range_checks(None):
        with pytest.raises(ValueError, match=match):
            getattr(ops, name)(**{**make_args(), **changes})
