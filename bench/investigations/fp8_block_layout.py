"""How this torch's `_scaled_mm` reads block-wise FP8 scales on the GPU (teacher_server/fp8.py).

    python -m bench.investigations.fp8_block_layout      # one Hopper GPU, seconds

The block path (1 x 128 activation scales, 128 x 128 weight scales) gave wrong products on an
H200 while the row path was right. Three questions, each answered by a table:

1. For each shape (M rows, K in-features, N out-features), the relative error of `FP8Linear`
   (and of variants of how it hands the scales over) against the dequantize-then-matmul
   reference. A layout error gives ~1; FP8 rounding gives ~1e-2 or less.
2. Which weight scale cuBLAS reads: inputs and weights all ones, each weight tile's scale a
   distinct integer, each row's activation scales one-hot on K-block (row % K-blocks). Output
   [m, n] / 128 is then the weight scale read for tile (n // 128, m % K-blocks); a mismatch
   prints the tile it came from.
3. Which activation scale cuBLAS reads: each output column's weight non-zero only on K-block
   (n % K-blocks), weight scales all one, activation scales distinct integers. Output [m, n] /
   128 is the activation scale read for (m, n % K-blocks).
"""

from __future__ import annotations

import argparse

import torch

from bench.table import emit
from teacher_server import fp8

SHAPES = [(64, 512, 384), (37, 512, 384), (64, 256, 384), (37, 256, 384), (64, 768, 768), (256, 768, 2048),
          (4096, 768, 2048), (4096, 2048, 768), (8192, 4096, 14336), (8192, 14336, 4096)]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30)).item()


def mm(xq, wq, xs, ws_kn) -> torch.Tensor:
    return torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws_kn, out_dtype=torch.float32)


def variants(m: int, k: int, n: int) -> dict[str, str]:
    """Relative error of each way of handing the scales over, against the reference."""
    torch.manual_seed(m * 7 + k + n)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16).pow(3)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
    wq, ws = fp8.quantize_tiles(w)
    reference = fp8.reference_linear(x, wq, ws, "block").float()
    layer = fp8.FP8Linear(wq, ws, "block")
    out = {}

    def attempt(name, fn):
        try:
            out[name] = f"{rel(fn(), reference):.2e}"
        except Exception as error:  # noqa: BLE001 - the table says what each variant raised
            out[name] = type(error).__name__ + ": " + str(error).split("\n")[0][:60]

    attempt("FP8Linear", lambda: layer(x))
    xq, xs = fp8.quantize_row_blocks(x)
    xs_m = xs.t().contiguous().t()
    kb = ws.shape[1]
    attempt("unpadded K", lambda: mm(xq, wq, xs_m, ws.t()))
    # M padded to a multiple of 4 / 16 rows (the activation scales' leading dimension aligned).
    for multiple in (4, 16):
        def padded_rows(multiple=multiple):
            rows = -(-m // multiple) * multiple
            xp = torch.nn.functional.pad(x, (0, layer._k_pad, 0, rows - m))
            q, s = fp8.quantize_row_blocks(xp)
            return torch._scaled_mm(q, layer.weight.t(), scale_a=s.t().contiguous().t(), scale_b=layer._scale_b,
                                    out_dtype=torch.float32)[:m]
        attempt(f"M to x{multiple}", padded_rows)
    # Weight scales padded (not the data), as torch's own tests pad them: [Nb, L4] then .t().
    def scale_padded():
        l4 = -(-kb // 4) * 4
        padded = torch.ones(ws.shape[0], l4, device="cuda")
        padded[:, :kb] = ws
        return mm(xq, wq, xs_m, padded[:, :kb].t())
    attempt("scales padded", scale_padded)
    attempt("row-major xs", lambda: mm(xq, wq, xs, ws.t()))
    return out


def probe_weight_scales(m: int, k: int, n: int) -> str:
    kb, nb = k // 128, -(-n // 128)
    ones_x = torch.ones(m, k, device="cuda").to(fp8.FP8)
    xs = torch.zeros(m, kb, device="cuda")
    xs[torch.arange(m), torch.arange(m) % kb] = 1.0
    ws = (1 + torch.arange(nb * kb, device="cuda", dtype=torch.float32)).reshape(nb, kb)
    ones_w = torch.ones(n, k, device="cuda").to(fp8.FP8)
    got = mm(ones_x, ones_w, xs.t().contiguous().t(), ws.t()) / 128
    want = ws[torch.arange(n, device="cuda") // 128][:, torch.arange(m, device="cuda") % kb].t()
    return _describe(got, want, kb, "tile (n-block, k-block)")


def probe_activation_scales(m: int, k: int, n: int) -> str:
    kb, nb = k // 128, -(-n // 128)
    x = torch.ones(m, k, device="cuda").to(fp8.FP8)
    xs = (1 + torch.arange(m * kb, device="cuda", dtype=torch.float32)).reshape(m, kb)
    w = torch.zeros(n, kb, 128, device="cuda")
    w[torch.arange(n), torch.arange(n) % kb] = 1.0
    w = w.reshape(n, k).to(fp8.FP8)
    ws = torch.ones(nb, kb, device="cuda")
    got = mm(x, w, xs.t().contiguous().t(), ws.t()) / 128
    want = xs[:, torch.arange(n, device="cuda") % kb]
    return _describe(got, want, kb, "(row, k-block)")


def _describe(got: torch.Tensor, want: torch.Tensor, kb: int, what: str) -> str:
    wrong = (got - want).abs() > 1e-3 * want.abs()
    if not wrong.any():
        return "all read right"
    i, j = [int(v) for v in wrong.nonzero()[0]]
    value = got[i, j].item()
    source = divmod(round(value) - 1, kb) if abs(value - round(value)) < 1e-3 and value >= 1 else "not an integer"
    return (f"{wrong.float().mean().item():.1%} wrong; first at out[{i}, {j}]: read {value:g} = {what} {source}, "
            f"wanted {want[i, j].item():g}")


def guarded(probe, *shape) -> str:
    try:
        return probe(*shape)
    except Exception as error:  # noqa: BLE001 - the table says what the probe raised
        return type(error).__name__ + ": " + str(error).split("\n")[0][:80]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    lines = [f"Block-wise FP8 scales through torch._scaled_mm on {torch.cuda.get_device_name()} "
             f"(torch {torch.__version__}, cuBLAS {torch.backends.cuda.preferred_blas_library()})", ""]
    rows = [(shape, variants(*shape)) for shape in SHAPES]
    names = list(rows[0][1])
    lines += ["| M x K x N | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    lines += [f"| {m} x {k} x {n} | " + " | ".join(v[name] for name in names) + " |" for (m, k, n), v in rows]
    lines += ["", "| M x K x N | weight scales read | activation scales read |", "|---|---|---|"]
    for m, k, n in SHAPES[:6]:
        lines.append(f"| {m} x {k} x {n} | {guarded(probe_weight_scales, m, k, n)} | "
                     f"{guarded(probe_activation_scales, m, k, n)} |")
    emit(lines, args.out)


if __name__ == "__main__":
    main()
