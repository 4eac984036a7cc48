"""tessel.observe.metrics: the peak MFU is measured against on a GPU."""

from __future__ import annotations

import pytest
import torch

from tessel.observe.metrics import spec_sheet_peak


@pytest.fixture
def fp32_precision():
    before = torch.get_float32_matmul_precision()
    yield torch.set_float32_matmul_precision
    torch.set_float32_matmul_precision(before)


def test_bf16_runs_are_measured_against_the_tensor_cores_bf16_peak():
    assert spec_sheet_peak("NVIDIA H100 80GB HBM3", torch.bfloat16) == 989e12
    assert spec_sheet_peak("NVIDIA A100-SXM4-80GB", torch.float16) == 312e12
    assert spec_sheet_peak("NVIDIA H100 PCIe", torch.bfloat16) == 756e12  # not the SXM part's


def test_fp32_runs_are_measured_against_what_torch_runs_them_on(fp32_precision):
    # torch's default ("highest") keeps fp32 matmuls off the tensor cores: an H100's 67 TFLOP/s, not
    # TF32's 494, or MFU would read 7x too low
    fp32_precision("highest")
    assert spec_sheet_peak("NVIDIA H100 80GB HBM3", torch.float32) == 67e12
    fp32_precision("high")  # TF32 allowed
    assert spec_sheet_peak("NVIDIA H100 80GB HBM3", torch.float32) == 494e12


def test_an_unknown_gpu_has_no_spec_sheet_peak():
    assert spec_sheet_peak("NVIDIA GeForce RTX 4090", torch.bfloat16) is None  # measured instead
