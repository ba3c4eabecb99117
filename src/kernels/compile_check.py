"""Compile every Triton kernel for a CUDA target without a GPU (ahead of time, down to cubin).

CI has no GPU and the interpreter never runs triton's compiler, so this is what catches a
kernel that interprets fine but does not compile (an unsupported construct, a type mismatch in
a loop, a dot shape below the hardware minimum). Run it in a process where triton is imported
in compile mode (TRITON_INTERPRET unset)::

    python -m triode.kernels.compile_check [--arch 90]

It prints each kernel's shared memory and register use and exits non-zero on a failure.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from typing import Any

from triode.kernels._jit import LazyKernel, import_triton

# name -> scalar type for the arguments that are not i32 and not pointers
_FLOAT_ARGS = {"scale_log2e": "fp32", "eps": "fp32"}


def _configs(dtype: str) -> list[tuple[LazyKernel, dict[str, str], dict[str, Any], int, str]]:
    """(kernel, pointer element types, constexprs, num_warps, label) for representative
    launches, with the num_warps their launchers pick."""
    # (import_module: the package's rms_norm/... attributes are the dispatch functions)
    decode_triton, kv_write, prefill_attention, rms_norm, rotary, silu_mul = (
        importlib.import_module(f"triode.kernels.{name}")
        for name in ("decode_triton", "kv_write", "prefill_attention", "rms_norm", "rotary", "silu_mul")
    )
    fp32_dot = "ieee" if dtype == "fp32" else "tf32"
    attention_ptrs = {"out_ptr": dtype, "query_ptr": dtype, "k_cache_ptr": dtype, "v_cache_ptr": dtype,
                      "part_out_ptr": "fp32", "part_max_ptr": "fp32", "part_sum_ptr": "fp32",
                      "block_tables_ptr": "i32", "seq_lens_ptr": "i32", "query_start_loc_ptr": "i32"}
    decode = dict(GROUP=4, BLOCK_G=16, HEAD_DIM=128, BLOCK_D=128, BLOCK_SIZE=16, BLOCK_N=64,
                  DOT_PRECISION=fp32_dot)
    blocks = 32 if dtype == "fp32" else 64
    return [
        (kv_write._write_kv_kernel, {"key_ptr": dtype, "value_ptr": dtype, "k_cache_ptr": dtype,
                                     "v_cache_ptr": dtype, "slot_mapping_ptr": "i64"},
         dict(KV_HEADS=8, HEAD_DIM=128, BLOCK_H=8, BLOCK_D=128), 1, "kv heads 8, dim 128"),
        (decode_triton.decode_partition_kernel, attention_ptrs, {**decode, "SPLIT": True}, 4,
         "split, GQA 4"),
        (decode_triton.decode_partition_kernel, attention_ptrs,
         {**decode, "GROUP": 1, "HEAD_DIM": 64, "BLOCK_D": 64, "SPLIT": False}, 4, "unsplit, GQA 1, dim 64"),
        (decode_triton.decode_reduce_kernel, attention_ptrs, dict(HEAD_DIM=128, BLOCK_D=128, BLOCK_P=32),
         4, "dim 128"),
        (prefill_attention._prefill_kernel, attention_ptrs,
         dict(GROUP=4, HEAD_DIM=128, BLOCK_D=128, BLOCK_SIZE=16, BLOCK_M=blocks, BLOCK_N=blocks,
              DOT_PRECISION=fp32_dot), 4, f"GQA 4, dim 128, {blocks}x{blocks} tiles"),
        (rms_norm._rms_norm_kernel, {"out_ptr": dtype, "residual_out_ptr": dtype, "x_ptr": dtype,
                                     "residual_ptr": dtype, "weight_ptr": dtype},
         dict(HAS_RESIDUAL=True, BLOCK=4096), 8, "hidden 4096 + residual"),
        (rotary._rotary_kernel, {"positions_ptr": "i64", "query_ptr": dtype, "key_ptr": dtype,
                                 "cos_sin_ptr": "fp32"},
         dict(NUM_HEADS=32, NUM_KV_HEADS=8, HALF=64, BLOCK_HQ=32, BLOCK_HK=8, BLOCK_HALF=64), 4, "32/8 heads"),
        (silu_mul._silu_and_mul_kernel, {"out_ptr": dtype, "x_ptr": dtype}, dict(BLOCK=1024), 4, "block 1024"),
    ]


def compile_all(arch: int = 90, dtypes: tuple[str, ...] = ("bf16", "fp32"), *, verbose: bool = True) -> list[str]:
    """Compiles every kernel configuration; returns the failures (empty when all compiled)."""
    triton = import_triton(interpret=False)
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", arch, 32)
    failures = []
    for dtype in dtypes:
        for kernel, pointers, constexprs, num_warps, label in _configs(dtype):
            fn = kernel.jitted()
            signature = {}
            for name in fn.arg_names:
                if name in constexprs:
                    signature[name] = "constexpr"
                elif name.endswith("_ptr"):
                    signature[name] = "*" + pointers[name]
                else:
                    signature[name] = _FLOAT_ARGS.get(name, "i32")
            what = f"{kernel.__name__} [{dtype}, {label}]"
            started = time.perf_counter()
            try:
                compiled = triton.compile(ASTSource(fn, signature, constexprs), target=target,
                                          options={"num_warps": num_warps})
            except Exception as error:
                failures.append(f"{what}: {type(error).__name__}: {error}")
                if verbose:
                    print(f"FAIL {what}: {error}", flush=True)
                continue
            if verbose:
                metadata = compiled.metadata
                print(f"ok   {what}: shared {metadata.shared} B, warps {metadata.num_warps}, "
                      f"{time.perf_counter() - started:.1f}s", flush=True)
    return failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Compile every Triton kernel for a CUDA target.")
    parser.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90 (Hopper)")
    args = parser.parse_args(argv)
    failures = compile_all(args.arch)
    if failures:
        print(f"{len(failures)} kernel configurations failed to compile", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
