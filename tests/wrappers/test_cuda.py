"""CUDA paths in one process. This machine has no GPU: these run where one is present."""

from __future__ import annotations

import pytest
import torch

from comm_wrappers import AmpOptimWrapper

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_fp16_autocast_and_grad_scaler_on_cuda() -> None:
    model = torch.nn.Linear(2, 1, bias=False).cuda()
    torch.nn.init.ones_(model.weight)
    wrapper = AmpOptimWrapper(torch.optim.SGD(model.parameters(), lr=1.0), loss_scale=1024.0)
    assert wrapper.cast_dtype == torch.float16  # the default on CUDA
    with wrapper.optim_context(model):
        out = model(torch.ones(1, 2, device="cuda"))
    assert out.dtype == torch.float16
    wrapper.update_params(out.float().sum())
    # The scaled gradient is unscaled before the step: weight 1 - 1 * grad 1 = 0.
    assert model.weight.tolist() == [[0.0, 0.0]]
    assert wrapper.state_dict()["loss_scaler"]["scale"] == 1024.0
