"""The profiled window's summary (`benchmarks.common.breakdown`): kernel names of an H100/H200 trace go
to the right category, the device's idle time is the wall time minus the union of its kernels, the three
largest costs are ranked with device idle among them, host self times exclude the children, and a real
profiler window on the CPU gives the same structure the GPU rows record."""
from __future__ import annotations

import pytest
import torch

from benchmarks.common.breakdown import (DEVICE_IDLE, Interval, breakdown_line, category, profile_window,
                                         self_times, summarize, union_us)

#: kernel names as torch 2.11 / cuBLAS 12.9 / cuDNN 9.x / Triton 3.6 name them on sm90
NAMES = {
    "nvjet_tst_256x128_64x4_1x2_h_bz_coopA_NNT": "gemm",
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel__5x_cublas": "gemm",
    "void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_nn_align8>(cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_nn_align8::Params)": "gemm",
    "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128, 4, false, false, cutlass::bfloat16_t>, true>": "attention",
    "fmha_cutlassF_bf16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel<cutlass::bfloat16_t>::Params)": "attention",
    "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x64_4x1x1_cga1x1x1_kernel0_0": "attention",
    "_softmax_xent_rows_kernel": "fused loss (Triton)",
    "_scores_kernel": "fused loss (Triton)",
    "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::TensorListMetadata<4>, at::native::(anonymous namespace)::FusedAdamMathFunctor<float, 4, (at::native::ADAM_MODE)1, false>>": "optimizer",
    "void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::BFloat16, float, false>(int, float, c10::BFloat16 const*)": "norm",
    "void at::native::vectorized_elementwise_kernel<4, at::native::GeluCUDAKernelImpl(at::TensorIteratorBase&, at::native::GeluType)": "elementwise / reduction",
    "void at::native::(anonymous namespace)::fused_dropout_kernel_vec<c10::BFloat16, float, unsigned int, 1, 4, bool>": "elementwise / reduction",
    "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)": "communication",
    "Memcpy HtoD (Pinned -> Device)": "memcpy / memset",
    "Memset (Device)": "memcpy / memset",
    "some_kernel_nobody_named": "other",
}


@pytest.mark.parametrize("name", list(NAMES))
def test_kernel_names_go_to_their_category(name):
    assert category(name) == NAMES[name]


def test_union_counts_overlapping_kernels_once():
    assert union_us([(0, 10), (5, 15), (20, 25), (21, 22)]) == 20
    assert union_us([]) == 0


def test_device_summary_ranks_costs_with_the_idle_time_of_the_device():
    """Two steps of 10 ms wall: a GEMM and an attention kernel overlap for 1 ms; 8 ms busy in all."""
    events = [Interval("nvjet_tst_x", 0, 3000, True), Interval("flash_fwd_kernel", 2000, 4000, True),
              Interval("_softmax_xent_rows_kernel", 10000, 14000, True),
              Interval("void at::native::vectorized_layer_norm_kernel<float>", 15000, 16000, True),
              Interval("cudaStreamSynchronize", 16000, 19000, False, 3000.0)]
    b = summarize(events, wall_s=0.020, steps=2)
    assert b["wall_ms_per_step"] == 10 and b["device_busy_ms_per_step"] == 4.5
    assert b["device_idle_ms_per_step"] == 5.5
    assert [x["cost"] for x in b["largest"]] == [DEVICE_IDLE, "fused loss (Triton)", "gemm"]
    assert b["largest"][0]["share_of_wall"] == 0.55 and b["ms_per_step"]["attention"] == 1.0
    assert b["top_kernels"][0] == {"name": "_softmax_xent_rows_kernel", "category": "fused loss (Triton)",
                                   "calls": 1, "ms_per_step": 2.0}
    assert b["top_host_ops"] == [{"name": "cudaStreamSynchronize", "self_ms_per_step": 1.5}]
    assert breakdown_line(b) == "device idle (waiting for the host) 55% / fused loss (Triton) 20% / gemm 15%"


def test_host_self_time_leaves_out_the_children_per_thread():
    host = [(1, 0.0, -100.0, "aten::linear"), (1, 10.0, -60.0, "aten::addmm"), (1, 20.0, -30.0, "cudaLaunchKernel"),
            (1, 70.0, -80.0, "aten::gelu"), (2, 5.0, -50.0, "aten::mm")]
    times = {e.name: e.self_us for e in self_times(host)}
    assert times == {"aten::linear": 40.0, "aten::addmm": 40.0, "cudaLaunchKernel": 10.0, "aten::gelu": 10.0,
                     "aten::mm": 45.0}


def test_a_real_window_on_the_cpu_sums_operator_self_times():
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.LayerNorm(256))
    x = torch.randn(128, 64)
    b = profile_window(lambda: model(x).sum().backward(), 2, cuda=False)
    assert "error" not in b and b["steps"] == 2 and b["source"] == "cpu operators (self time)"
    assert {"gemm", "norm"} <= set(b["ms_per_step"]) and len(b["largest"]) == 3
    assert sum(b["ms_per_step"].values()) <= b["wall_ms_per_step"] * 1.05
    assert b["device_idle_ms_per_step"] is None and b["top_kernels"] == []


def test_a_profiler_failure_is_the_breakdowns_error_not_the_rows():
    def broken():
        raise RuntimeError("CUPTI_ERROR_NOT_INITIALIZED")

    assert profile_window(broken, 1, cuda=False) == {"error": "RuntimeError: CUPTI_ERROR_NOT_INITIALIZED"}
    assert breakdown_line({"error": "x"}) == "breakdown failed: x" and breakdown_line(None) == ""
