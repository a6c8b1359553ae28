"""Paged attention over long prompts (kernels/paged_attention.py): 1,000 keys walked by one program; 2,000 or
4,000 cut into pieces run by separate programs and summed by a second kernel; the result equals the reference, a
row's bits do not depend on its batch-mates (nor on whether the pass could split at all), and the bf16 tensor-core branch (DOT_BF16)
runs in the interpreter with exact bf16 products. Data and tolerances: test_paged_attention.py's."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from test_paged_attention import CASES, TOLS, _on, canvas, causal, make_case  # noqa: E402

from dgcli.kernels.reference_ops import paged_attention_reference  # noqa: E402


def prompt(length: int, window: int = 0, ring: int = 0, canvas_rows: int = 32) -> tuple:
    """A prompt of `length` tokens as a pass sees it: its last 4 rows (a prompt chunk's end), then a canvas over
    the prompt and itself; GQA 2, head dim 32, blocks of 64 (a ring of `ring` under a sliding `window`)."""
    end = length + canvas_rows
    lo = max(0, length - window + 1) if window else 0
    return (4, 2, 32, 64, ring, [(end, causal(length - 4, length, window) + canvas(canvas_rows, lo, end)),
                                 (700, canvas(3, 0, 700))])


def _check(case, dtype, atol, rtol, device):
    from dgcli.kernels.paged_attention import paged_attention

    args, _ = make_case(*case, dtype)
    got = paged_attention(*_on(device, args)).cpu()
    assert got.dtype == dtype and not got.isnan().any()
    torch.testing.assert_close(got, paged_attention_reference(*args), atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype,atol,rtol", TOLS)
def test_a_1000_token_prompt_matches_the_reference(dtype, atol, rtol, triton_device):
    """Its canvas reads 1,032 keys (one piece: a long walk), its prompt rows up to 1,000, a sequence beside it 700."""
    _check(prompt(1000), dtype, atol, rtol, triton_device)


@pytest.mark.slow
@pytest.mark.parametrize("dtype,atol,rtol", TOLS)
@pytest.mark.parametrize("window,ring", [(0, 0), (1500, 24)])
def test_a_4000_token_prompt_matches_the_reference(window, ring, dtype, atol, rtol, triton_device):
    """4,032 keys (four pieces), and a sliding layer's ring of 1,536 slots under a window of 1,500 (three pieces
    that wrap the ring); ~5 s each in the interpreter."""
    _check(prompt(4000, window, ring), dtype, atol, rtol, triton_device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_bits_do_not_depend_on_its_batch_mates(dtype, triton_device):
    """Each sequence alone (its own table, as narrow as it needs: a pass that cannot split) and in a pass with a
    2,100-token and a 700-token sequence (a pass that splits the first): the same bits."""
    from dgcli.kernels.paged_attention import paged_attention

    args, _ = make_case(*prompt(2100), dtype)
    q, k_pool, v_pool, row_seq, row_lo, row_hi, tables, bs, ring = args
    together = paged_attention(*_on(triton_device, args)).cpu()
    for s in (0, 1):
        rows = row_seq == s
        width = -(-int(row_hi[rows].max()) // bs)  # the blocks this sequence's rows read
        alone = (q[rows], k_pool, v_pool, torch.zeros_like(row_seq[rows]), row_lo[rows], row_hi[rows],
                 tables[s:s + 1, :width].contiguous(), bs, ring)
        assert torch.equal(paged_attention(*_on(triton_device, alone)).cpu(), together[rows]), s


@pytest.mark.parametrize("name", ["causal", "canvas", "ring", "gqa3"])
def test_the_tensor_core_branch_matches_the_reference(name, triton_device):
    """bf16 operands straight into tl.dot (the branch a GPU runs), probabilities rounded to bf16 for P·V."""
    _check(CASES[name], torch.bfloat16, *TOLS[1][1:], triton_device)


def test_the_tensor_core_branch_over_a_long_prompt(triton_device):
    """2,132 keys: two pieces and their combine."""
    _check(prompt(2100), torch.bfloat16, *TOLS[1][1:], triton_device)
