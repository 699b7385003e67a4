"""Compile every kernel variant the launchers can start, ahead of time for a Hopper GPU (sm_90),
without a GPU: Triton lowers to PTX and its bundled ptxas assembles the cubin. Catches errors the
interpreter cannot see (types, layouts, dot shapes) and reports registers and stack (spills).

Run as `python -m tests.kernels.compile_sm90` with TRITON_INTERPRET unset; prints the Triton
version, then one JSON line per variant: {"kernel", "variant", "registers", "stack_bytes"}. Another
Triton (the GPU image's, side by side) goes first on PYTHONPATH: `test_compile_sm90.py`.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from pipeline.kernels import linear_cross_entropy as lce
from pipeline.kernels import sequence_contrastive as seq
from pipeline.kernels import token_contrastive as tok

TARGET = GPUTarget("cuda", 90, 32)
HIDDEN, VOCAB, CANDIDATES = 1024, 30522, 51  # BERT-large, K = 50 negatives + the positive


def _signature(fn, pointers: dict[str, str], floats: tuple[str, ...], constexprs: dict) -> dict[str, str]:
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in pointers:
            sig[name] = pointers[name]
        else:
            sig[name] = "fp32" if name in floats else "i32"
    return sig


def _resources(cubin: bytes) -> tuple[int, int]:
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True, check=True).stdout
    match = re.search(r"REG:(\d+) STACK:(\d+)", out)
    return int(match.group(1)), int(match.group(2))


def compile_variant(fn, variant: str, pointers: dict, floats: tuple, constexprs: dict, num_warps: int, num_stages: int = 3) -> dict:
    src = ASTSource(fn, _signature(fn, pointers, floats, constexprs), constexprs=constexprs)
    kernel = triton.compile(src, target=TARGET, options=dict(num_warps=num_warps, num_stages=num_stages))
    regs, stack = _resources(kernel.asm["cubin"])
    return dict(kernel=fn.__name__, variant=variant, registers=regs, stack_bytes=stack)


def variants():
    block_v, warps = lce.rows_launch_config(VOCAB)
    rows_ptrs = dict(z_ptr="*fp32", bias_ptr="*fp32", targets_ptr="*i64", copy_prob_ptr="*fp32",
                     corrupted_ptr="*i64", loss_ptr="*fp32", correct_ptr="*fp32", inv_count_ptr="*fp32")
    # a bf16 / fp16 gradient is written into the fp32 scores' own rows (NARROW_IN_PLACE), as the launchers do
    for grad, bias, corrective, write, argmax in (
            ("*fp32", True, False, True, False), ("*bf16", True, True, True, False), ("*fp16", False, False, True, False),
            ("*fp32", False, False, False, False), ("*bf16", True, False, True, True), ("*fp32", True, False, True, True),
            ("*bf16", True, False, True, False)):  # bf16 without argmax: COCO-LM's generator, MLM without accuracy
        narrow = write and grad != "*fp32"
        yield (lce._softmax_xent_rows_kernel,
               f"grad={grad[1:]} bias={bias} corrective={corrective} write={write} argmax={argmax}",
               {**rows_ptrs, "grad_ptr": grad}, ("copy_prob_max",),
               dict(HAS_BIAS=bias, CORRECTIVE=corrective, WRITE_GRAD=write, ARGMAX=argmax, NARROW_IN_PLACE=narrow,
                    BLOCK_V=block_v), warps)

    block_k, block_h, warps = tok._blocks(HIDDEN, CANDIDATES)
    for dt in ("*bf16", "*fp32"):
        base = dict(x_ptr=dt, anchor_idx_ptr="*i64", y_ptr=dt, cand_ptr="*i64", bias_ptr=dt)
        taco = dict(HAS_ANCHOR_IDX=True, HAS_BIAS=False, NORMALIZE=True, MASK_DUPLICATES=False)
        nce = dict(HAS_ANCHOR_IDX=False, HAS_BIAS=True, NORMALIZE=False, MASK_DUPLICATES=True)
        blocks = dict(BLOCK_K=block_k, BLOCK_H=block_h)
        for name, flags in (("taco", taco), ("nce", nce)):
            yield (tok._gathered_forward_kernel, f"{name} {dt[1:]}",
                   {**base, "loss_ptr": "*fp32", "lse_ptr": "*fp32", "dx_ptr": "*fp32"}, ("scale", "eps", "inv_count"),
                   {**flags, **blocks, "ANCHOR_GRAD": True}, warps)
            yield (tok._gathered_candidate_grad_kernel, f"{name} {dt[1:]}",
                   {**base, "lse_ptr": "*fp32", "dy_ptr": "*fp32", "dbias_ptr": "*fp32"}, ("scale", "eps", "inv_count"),
                   {**flags, **blocks, "CAND_GRAD": True, "BIAS_GRAD": name == "nce"}, warps)

    bm, bn, bd, warps = seq.SCORE_BLOCKS
    mm, mk, md, mwarps = seq.MATMUL_BLOCKS
    for dt, precision in (("*bf16", "tf32"), ("*fp32", "tf32x3")):
        for batch_cols, same_view, groups in ((True, True, False), (True, False, False), (False, True, False),
                                              (True, False, True), (True, True, True)):
            yield (seq._scores_kernel, f"{dt[1:]} batch_cols={batch_cols} same_view={same_view} groups={groups}",
                   dict(x_ptr=dt, x_norm_ptr="*fp32", y_ptr=dt, y_norm_ptr="*fp32", s_ptr="*fp32", groups_ptr="*i64"),
                   ("inv_tau", "eps"),
                   dict(BATCH_COLS=batch_cols, SAME_VIEW=same_view, NORMALIZE=True, HAS_GROUPS=groups,
                        PRECISION=precision, BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=bd), warps)
        yield (seq._scaled_matmul_kernel, dt[1:],
               dict(a_ptr="*fp32", k_norm_ptr="*fp32", b_ptr=dt, out_ptr="*fp32"), ("inv_tau", "eps"),
               dict(NORMALIZE=True, SPLIT_HI_LO=dt == "*bf16", PRECISION=precision, BLOCK_M=mm, BLOCK_K=mk, BLOCK_D=md), mwarps)
        yield (seq._row_norms_kernel, dt[1:], dict(x_ptr=dt, out_ptr="*fp32"), (), dict(BLOCK_D=1024), 4)
        yield (seq._normalize_backward_kernel, dt[1:], dict(x_ptr=dt, norm_ptr="*fp32", g_ptr="*fp32"), ("eps",),
               dict(NORMALIZE=True, BLOCK_D=triton.next_power_of_2(HIDDEN)), 4)


def main() -> None:
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("compile_sm90: unset TRITON_INTERPRET (the interpreter cannot compile kernels)")
    print(json.dumps({"triton": triton.__version__, "path": os.path.dirname(triton.__file__)}), flush=True)
    for fn, variant, pointers, floats, constexprs, warps in variants():
        print(json.dumps(compile_variant(fn, variant, pointers, floats, constexprs, warps)), flush=True)


if __name__ == "__main__":
    main()
