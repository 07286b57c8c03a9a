"""The teacher's Triton kernels compiled for a Hopper GPU on a machine without one: every
configuration the server launches (the grouped FP8 product's autotuned tiles, the router's
softmax-and-top-k, the row and SwiGLU quantizations at the served widths) and, with --benches, the
tiles bench/investigations/fp8_grouped_tiles.py sweeps, through Triton's own compiler and ptxas
(the ones its wheel bundles) for sm_90a. What a GPU session would otherwise find first: a kernel
that does not compile (an operation the interpreter accepts and the compiler does not), one that
asks more shared memory than an H100/H200 block has (227 KiB); and which spill registers.

    pip install triton==3.6.0       (the GPU image's Triton; its wheel runs here, no GPU needed)
    python -m bench.triton_aot [--benches] [--out /tmp/aot.md]

It compiles with the pointer and integer specialisations a launch gives (16-byte aligned pointers,
strides and sizes divisible by 16 where the served shapes are), so the code is the launch's in all
but the autotuner's choice. Registers and spills are ptxas's (-v) on the compiled PTX. Nothing runs:
a kernel's values are the GPU tests' business (tests/gpu/test_moe_gpu.py), and under Triton's
interpreter the CPU tests'. Exits 1 when a served configuration does not compile or asks too much
shared memory (a spill is reported, not failed: it costs time, and the autotuner times such a tile
against the others).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

from bench.table import emit

MAX_SHARED = 232448  # bytes of shared memory a block may opt into on sm_90 (H100, H200): 227 KiB
DIVISIBLE = [["tt.divisibility", 16]]


@dataclass
class Case:
    label: str
    served: bool  # a configuration the server launches (else a bench's)
    kernel: object
    types: dict  # argument -> Triton type ("*bf16", "i32", ...); constexprs go in `constants`
    constants: dict
    warps: int
    stages: int = 3
    divisible: tuple = ()  # arguments a launch passes divisible by 16 (pointers always are)
    results: dict = field(default_factory=dict)


def _signature(kernel, types: dict, constants: dict) -> dict:
    signature = {}
    for index, name in enumerate(kernel.arg_names):
        if kernel.params[index].is_constexpr:
            if name not in constants:
                raise KeyError(f"{kernel.__name__}: no value for the constexpr {name}")
            signature[name] = "constexpr"
        else:
            signature[name] = types.get(name, "*i8" if name.endswith("_ptr") else "i32")
    return signature


def compile_case(case: Case, target, ptxas: str) -> dict:
    """Compiles one case; returns its shared memory, registers, spills and verdict."""
    import triton
    from triton.compiler import ASTSource

    kernel = case.kernel
    signature = _signature(kernel, case.types, case.constants)
    attrs = {(i,): DIVISIBLE for i, name in enumerate(kernel.arg_names)
             if signature[name].startswith("*") or name in case.divisible}
    source = ASTSource(kernel, signature, constexprs=case.constants, attrs=attrs)
    started = time.monotonic()
    try:
        compiled = triton.compile(source, target=target, options={"num_warps": case.warps,
                                                                   "num_stages": case.stages})
    except Exception as e:  # noqa: BLE001 - a kernel that does not compile is this tool's finding
        first = str(e).strip().splitlines()
        return dict(verdict=f"does not compile: {type(e).__name__}: {first[-1] if first else ''}"[:200])
    shared = int(compiled.metadata.shared)
    registers, spills = _ptxas_usage(ptxas, compiled.asm["ptx"], target.arch)
    # Over the shared memory a block has, the launch fails (Triton's OutOfResources); a spill only
    # costs time (the autotuner times such a tile against the others).
    verdict = (f"shared memory {shared} > {MAX_SHARED}: the launch fails" if shared > MAX_SHARED
               else f"ok, spills {spills} bytes" if spills else "ok")
    return dict(shared=shared, registers=registers, spills=spills, seconds=time.monotonic() - started,
                verdict=verdict)


def _ptxas_usage(ptxas: str, ptx: str, arch: int) -> tuple[int, int]:
    with tempfile.TemporaryDirectory() as scratch:
        path = os.path.join(scratch, "kernel.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        done = subprocess.run([ptxas, f"-arch=sm_{arch}a", "-v", path, "-o", os.path.join(scratch, "k.cubin")],
                              capture_output=True, text=True, timeout=600)
    report = done.stdout + done.stderr
    registers = re.search(r"Used (\d+) registers", report)
    stores = re.search(r"(\d+) bytes spill stores", report)
    return (int(registers.group(1)) if registers else -1), (int(stores.group(1)) if stores else 0)


# The products the teacher serves, by model (N, K, what the launch passes): Qwen3-30B-A3B's
# first product as served (gathered rows, gate and up interleaved, the gate in the epilogue; row
# scales), also plain (block scales keep transformers' layout) and its second (rows written by
# index); gpt-oss-20b's (K 2,880: masked K steps; row scales only).
PRODUCTS = [
    ("qwen gate_up gated", 1536, 2048, dict(HAS_GATHER=True, HAS_SCATTER=False, GATE_GROUP=64)),
    ("qwen gate_up", 1536, 2048, dict(HAS_GATHER=True, HAS_SCATTER=False, GATE_GROUP=0)),
    ("qwen down", 2048, 768, dict(HAS_GATHER=False, HAS_SCATTER=True, GATE_GROUP=0)),
    ("gpt-oss gate_up", 5760, 2880, dict(HAS_GATHER=True, HAS_SCATTER=False, GATE_GROUP=0)),
    ("gpt-oss down", 2880, 2880, dict(HAS_GATHER=False, HAS_SCATTER=True, GATE_GROUP=0)),
]
EXPERTS = 128


def _product_cases(config: dict, persistent: bool, served: bool, name: str, fast_options=(True, False),
                   products=PRODUCTS) -> list[Case]:
    from teacher_server import fp8_grouped_gemm as g

    kernel = g._grouped_fp8_mm_persistent_kernel if persistent else g._grouped_fp8_mm_kernel
    block_k = config.get("BLOCK_K", g.BLOCK)
    cases = []
    for product, n, k, flags in products:
        for block_scaled in (False, True):
            if block_scaled and (k % g.BLOCK or flags["GATE_GROUP"] or block_k != g.BLOCK or "gpt-oss" in product):
                continue  # block scales: K in whole blocks, transformers' gate layout, steps of 128
            if not block_scaled and flags["GATE_GROUP"] == 0 and product == "qwen gate_up":
                continue  # with row scales the first product is served gated
            for fast in fast_options:
                if fast and block_scaled:
                    continue
                if served and fast != persistent:
                    continue  # autotuned: the persistent kernel for fast accumulation, the plain one otherwise
                constants = dict(NUM_EXPERTS=EXPERTS, EXPERTS_POW2=EXPERTS, BLOCK_SCALED=block_scaled,
                                 K_ALIGN=k & -k if k & (g.MAX_BLOCK_K - 1) else g.MAX_BLOCK_K, FAST_ACCUM=fast,
                                 BLOCK_M=config["BLOCK_M"], BLOCK_N=config["BLOCK_N"], BLOCK_K=block_k, **flags)
                if persistent:
                    constants.update(PER_SM=config["PER_SM"], FLATTEN=config.get("FLATTEN", False),
                                     TMA_W=config.get("TMA_W", False))
                types = dict(a_ptr="*fp8e4nv", a_scale_ptr="*fp32", gather_ptr="*i64", w_ptr="*fp8e4nv",
                             w_scale_ptr="*fp32", out_ptr="*bf16", scatter_ptr="*i64", route_ptr="*bf16",
                             offsets_ptr="*i32")
                mode = "block" if block_scaled else "row fast" if fast else "row"
                cases.append(Case(f"{name}: {product}, {mode}", served, kernel, types, constants,
                                  config["num_warps"], config["num_stages"],
                                  divisible=("N", "K", "stride_am", "stride_we", "stride_wn", "stride_om")))
    return cases


def cases(benches: bool) -> list[Case]:
    from teacher_server import fp8_grouped_gemm as g
    from teacher_server import fp8_rows, routing

    out: list[Case] = []
    for config in g.CONFIGS:
        fixed = g.launch_config(config)
        out += _product_cases(fixed, False, True, f"plain {fixed['BLOCK_M']}x{fixed['BLOCK_N']} "
                                                  f"w{fixed['num_warps']} s{fixed['num_stages']}")
    for config in g.PERSISTENT_CONFIGS:
        fixed = g.launch_config(config)
        out += _product_cases(fixed, True, True, f"persistent {fixed['BLOCK_M']}x{fixed['BLOCK_N']} "
                                                 f"w{fixed['num_warps']} s{fixed['num_stages']} x{fixed['PER_SM']}"
                                                 f"{' TMA' if fixed.get('TMA_W') else ''}")
    # The router: Qwen3-MoE's 128 experts top-8, Mixtral's 8 top-2, OLMoE's 64 top-8, the widest.
    for dtype in ("bf16", "fp32"):
        for experts, k in ((128, 8), (8, 2), (64, 8), (routing.KERNEL_MAX_EXPERTS, routing.KERNEL_MAX_K)):
            width = max(1 << (experts - 1).bit_length(), 16)
            out.append(Case(f"router softmax_topk {experts} experts top-{k}, {dtype}", True,
                            routing._softmax_topk_kernel,
                            dict(logits_ptr=f"*{dtype}", values_ptr="*fp32", experts_ptr="*i64"),
                            dict(K=k, BLOCK_E=width, ROWS=max(1, min(16, 2048 // width))), 4))
    # The row quantization at the widths it serves (as fp8_rows.launch picks rows and warps), e4m3 or
    # float32 out (fp8_rows.check's quotients).
    for dtype in ("bf16", "fp16", "fp32"):
        for k in (768, 2048, 2880, 4096, 200, fp8_rows.KERNEL_MAX_WIDTH):
            width = max(1 << (k - 1).bit_length(), 16)
            rows = max(1, min(16, 4096 // width))
            warps = {1024: 2, 2048: 4, 4096: 16}.get(width, 4 if width < 4096 else 16)
            for q in ("fp8e4nv", "fp32"):
                out.append(Case(f"row quantization {k} wide, {dtype} -> {q}", True, fp8_rows._quantize_rows_kernel,
                                dict(x_ptr=f"*{dtype}", q_ptr=f"*{q}", scale_ptr="*fp32"),
                                dict(INV_MAX=fp8_rows.INV_FP8_MAX, BLOCK_K=width, ROWS=rows), warps,
                                divisible=("stride_x",)))
    # SwiGLU with the routing weight and the quantization (block scales' step between the products).
    for i in (768, 1536):
        for block_scaled in (True, False):
            out.append(Case(f"swiglu_quantize I {i}, {'block' if block_scaled else 'row'}", True,
                            g._swiglu_quantize_kernel,
                            dict(x_ptr="*bf16", weight_ptr="*bf16", q_ptr="*fp8e4nv", scale_ptr="*fp32"),
                            dict(INV_MAX=fp8_rows.INV_FP8_MAX, BLOCK_SCALED=block_scaled,
                                 BLOCK_I=max(1 << (i - 1).bit_length(), g.BLOCK), ROWS=4), 4,
                            divisible=("stride_x", "stride_q")))
    if benches:
        from bench.investigations.fp8_grouped_tiles import variants

        qwen = [p for p in PRODUCTS if p[0] in ("qwen gate_up gated", "qwen down")]
        for label, config in variants():
            out += _product_cases(config, "PER_SM" in config, False, f"bench {label}", fast_options=(True,),
                                  products=qwen)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--benches", action="store_true", help="also the tiles the grouped-product bench sweeps")
    parser.add_argument("--only", default="", help="comma-separated parts of labels: only those cases")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    try:
        import triton
        from triton.backends.compiler import GPUTarget
    except ImportError:
        sys.exit("bench.triton_aot needs Triton: pip install triton==3.6.0 (the GPU image's; no GPU needed)")
    target = GPUTarget("cuda", 90, 32)
    try:  # the ptxas Triton itself compiles sm_90 with (its newer releases bundle two)
        from triton.backends.nvidia.compiler import get_ptxas

        ptxas = get_ptxas(target.arch).path
    except (ImportError, AttributeError):
        ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    if not ptxas or not os.path.exists(ptxas):
        sys.exit(f"no ptxas at {ptxas}: this Triton wheel does not bundle NVIDIA's tools")
    chosen = [c for c in cases(args.benches) if not args.only or any(p in c.label for p in args.only.split(","))]
    lines = [f"Triton {triton.__version__}, sm_90a (H100/H200: {MAX_SHARED} bytes of shared memory a block), "
             f"{len(chosen)} kernels compiled, none run", "",
             "| kernel and configuration | served | shared bytes | registers | spill bytes | verdict |",
             "|---|---|---|---|---|---|"]
    failed = []
    for index, case in enumerate(chosen, 1):
        result = compile_case(case, target, ptxas)
        print(f"[{index}/{len(chosen)}] {case.label}: {result['verdict']}", file=sys.stderr, flush=True)
        lines.append(f"| {case.label} | {'yes' if case.served else ''} | {result.get('shared', '')} | "
                     f"{result.get('registers', '')} | {result.get('spills', '')} | {result['verdict']} |")
        if not result["verdict"].startswith("ok"):
            failed.append((case, result))
    served_failed = [c for c, _ in failed if c.served]
    spilling = sum(1 for line in lines if "spills" in line)
    lines += ["", f"{len(chosen) - len(failed)} ok ({spilling} of them spill), {len(failed)} not "
                  f"({len(served_failed)} of them served)"]
    emit(lines, args.out)
    sys.exit(1 if served_failed else 0)


if __name__ == "__main__":
    main()
