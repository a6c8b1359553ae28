"""CUDA's load-time fusion of projections: each attention's q/k/v and each dense MLP's gate/up as one GEMM (run
where `gemma._fused` says so). Must not: run on CPU (its path, bits and prepacked weights stay) or copy a weight.
"""

from __future__ import annotations

import torch
from torch import nn

from dgcli.model.gemma import MLP, Attention


@torch.no_grad()
def fuse_projections(model: nn.Module) -> int:
    """Plain bias-free CUDA `nn.Linear`s of one dtype become row views of one matrix `fused` (autograd keeps the
    separate GEMMs). Returns the groups fused (0 on CPU)."""
    done = 0
    for m in model.modules():
        lins = [getattr(m, n, None) for n in (("q_proj", "k_proj", "v_proj") if isinstance(m, Attention) else
                                              ("gate_proj", "up_proj") if isinstance(m, MLP) else ())]
        lins = [lin for lin in lins if lin is not None]
        if lins and all(type(lin) is nn.Linear and lin.weight.is_cuda and lin.bias is None
                        and lin.weight.dtype == lins[0].weight.dtype for lin in lins):
            w, row, done = torch.cat([lin.weight for lin in lins]), 0, done + 1  # [sum of outputs, H]
            for lin in lins:
                lin.weight, row = nn.Parameter(w.narrow(0, row, lin.out_features), False), row + lin.out_features
            m.__dict__["fused"] = w
    return done
