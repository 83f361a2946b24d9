"""CPU buffers on 2 MiB boundaries for transparent huge pages (ops.huge_pages)."""
import torch

from kvpage.ops import huge_pages


def test_a_huge_page_buffer_starts_on_a_2_mib_boundary_and_holds_what_is_asked():
    for nbytes in (1, 4096, 3 * huge_pages.HUGE_PAGE + 17):
        buffer = huge_pages.huge_page_empty(nbytes)
        assert buffer.dtype == torch.uint8 and buffer.numel() == nbytes and buffer.is_contiguous()
        assert buffer.data_ptr() % huge_pages.HUGE_PAGE == 0
        buffer.fill_(7)  # all of it is writable
        assert int(buffer.sum()) == 7 * nbytes


def test_huge_page_zeros_is_a_zeroed_tensor_of_the_shape_and_dtype():
    t = huge_pages.huge_page_zeros((5, 3, 16, 64), torch.bfloat16)
    assert t.shape == (5, 3, 16, 64) and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert t.data_ptr() % huge_pages.HUGE_PAGE == 0 and not t.any()
