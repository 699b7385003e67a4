"""COCO-LM's sampling logits: fp32 values from a GEMM in the training dtype on CUDA (fp32
accumulation, no fp32 copy of the weight), the fp32 reference elsewhere."""
from __future__ import annotations

import pytest
import torch

from pipeline.objectives.cocolm import sampling_logits
from pipeline.kernels.functional import fp32_logits


def inputs(device, dtype):
    g = torch.Generator().manual_seed(0)
    hidden, weight, bias = torch.randn(33, 64, generator=g), torch.randn(300, 64, generator=g), torch.randn(300, generator=g)
    return hidden.to(device, dtype), weight.to(device, dtype), bias.to(device, dtype)


def test_cpu_sampling_logits_are_the_fp32_reference():
    h, w, b = inputs("cpu", torch.bfloat16)
    z = sampling_logits(h, w, b)
    assert z.dtype == torch.float32
    assert torch.equal(z, fp32_logits(h, w, b))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_sampling_logits_accumulate_in_fp32_from_the_training_dtype(dtype):
    h, w, b = inputs("cuda", dtype)
    z = sampling_logits(h, w, b)
    assert z.dtype == torch.float32
    reference = fp32_logits(h, w, b)  # the same bf16/fp16 values, multiplied in fp32
    torch.testing.assert_close(z, reference, rtol=1e-4, atol=1e-3)
