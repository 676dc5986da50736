"""Lower chapter 07's kernel launches to Triton IR for a GPU target, on a machine without a GPU.

Triton's interpreter runs the kernels' Python on NumPy and accepts code a GPU compiler refuses (a
`tl.dot` with an inner dimension below 16, say) and computes every offset exactly, so it cannot see
an offset that would overflow int32 on a GPU. This script takes the launches the wrappers of
`minivllm.attention.ops.triton_attention` make (recorded, not run), and lowers each one through Triton's
front end for an sm_90 target (an H100/H200: the frontend's checks of shapes and dtypes, no
`ptxas`). It prints JSON, one entry per launch: the kernel, its constexprs, the error if lowering
failed, and the integer type of every offset added to a KV-cache pointer.

It must run in a process where `TRITON_INTERPRET` was never set: in interpreter mode Triton's own
library functions become interpreted functions, which the compiler cannot call. The test
(`tests/test_triton_kernels.py`) runs it in a subprocess.
"""
from __future__ import annotations

import json
import os
import re
import sys

assert os.environ.get("TRITON_INTERPRET", "0") != "1", "run without TRITON_INTERPRET"
NO_COMPILER_API = 3  # exit status: this Triton's compiler internals are not the ones used here

import torch  # noqa: E402

try:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler.compiler import make_backend
    from triton._C.libtriton import ir
except ImportError as e:  # internals move between Triton releases
    print(f"Triton's compiler internals differ from what this script uses: {e}", file=sys.stderr)
    sys.exit(NO_COMPILER_API)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import minivllm.attention.ops.triton_attention as ta  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
KERNELS = ("store_kvcache_kernel", "paged_decode_kernel", "reduce_splits_kernel", "paged_prefill_kernel")
# the pointers whose offsets must be int64: the caches (tens of GB on a GPU) and the KV store's inputs
# (the key and value rows of a whole prefill step, as strided views of one projection)
CACHE_POINTERS = ("k_cache_ptr", "v_cache_ptr", "k_ptr", "v_ptr")
POINTER_TYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.float64: "fp64",
                 torch.int64: "i64", torch.int32: "i32"}


class Recorder:
    """Stands in for a kernel: `kernel[grid](*args, **kwargs)` records the launch and runs nothing."""

    def __init__(self, name, kernel, launches):
        self.name, self.kernel, self.launches = name, kernel, launches

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((self.name, self.kernel, args, kwargs))


def lower(kernel, args, kwargs) -> str:
    """The Triton IR of one launch (as `kernel[grid](*args, **kwargs)` would compile it) for `TARGET`."""
    kwargs = dict(kwargs)
    options = {"num_warps": kwargs.pop("num_warps", 4)}
    bound = dict(zip(kernel.arg_names, args), **kwargs)
    constexpr = {p.num for p in kernel.params if p.is_constexpr}
    signature, constants = {}, {}
    for i, name in enumerate(kernel.arg_names):
        value = bound[name]
        if i in constexpr:
            signature[name], constants[(i,)] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[name] = "*" + POINTER_TYPES[value.dtype]
        elif isinstance(value, int):  # Triton passes an int that fits in 32 bits as i32
            signature[name] = "i32" if -2**31 <= value < 2**31 else "i64"
        else:
            signature[name] = "fp32"
    backend = make_backend(TARGET)
    options = backend.parse_options(options)
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    module = ASTSource(kernel, signature, constants).make_ir(
        TARGET, options, backend.get_codegen_implementation(options), backend.get_module_map(), context)
    return str(module)


@triton.jit
def _copy_kernel(x_ptr, y_ptr, BLOCK: tl.constexpr):
    """A kernel that surely lowers: if it does not, this script does not fit this Triton's internals."""
    i = tl.arange(0, BLOCK)
    tl.store(y_ptr + i, tl.load(x_ptr + i))


def offset_types(ir_text: str, roots=CACHE_POINTERS) -> list[str]:
    """The type of every offset added (`tt.addptr`) to a pointer derived from one of `roots`."""
    first_operand = {}  # SSA value -> the first operand of the operation that made it
    added = []
    for line in ir_text.splitlines():
        m = re.match(r"\s*(%[\w.]+) = (\S+) (%[\w.]+)", line)
        if not m:
            continue
        first_operand[m.group(1)] = m.group(3)
        if m.group(2) == "tt.addptr":
            added.append((m.group(3), line.split(" loc(")[0].rsplit(", ", 1)[-1].strip()))

    def root(value):
        while value in first_operand:
            value = first_operand[value]
        return value.lstrip("%")

    return [offset for pointer, offset in added if root(pointer) in roots]


def cases():
    """Wrapper calls with the shapes the tests cover and a few they cannot run under the interpreter."""
    t = lambda *shape, dtype: torch.zeros(*shape, dtype=dtype)  # noqa: E731
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for num_kv_heads, group, head_dim, block_size in ((8, 2, 128, 16), (2, 4, 80, 3), (1, 8, 8, 5), (4, 1, 64, 256)):
            k_cache = t(6, block_size, num_kv_heads, head_dim, dtype=dtype)
            q = t(3, num_kv_heads * group, head_dim, dtype=dtype)
            tables, lens = torch.zeros(3, 64, dtype=torch.int64), torch.ones(3, dtype=torch.int64)  # wide: splits
            ta.store_kvcache(q[:, :num_kv_heads], q[:, :num_kv_heads], k_cache, k_cache.clone(),
                             torch.zeros(3, dtype=torch.int64))
            for num_splits in (1, 3):
                ta.paged_decode_attention_triton(q, k_cache, k_cache.clone(), tables, lens, 0.1, num_splits=num_splits)
            ta.paged_prefill_attention_triton(q, k_cache, k_cache.clone(), tables, lens,
                                              torch.arange(4, dtype=torch.int64), 0.1)


def main() -> None:
    try:
        lower(_copy_kernel, (torch.zeros(16), torch.zeros(16)), {"BLOCK": 16})
    except Exception as e:  # not our kernels' fault: the compiler's internal API has moved
        print(f"Triton's compiler internals differ from what this script uses: {type(e).__name__}: {e}",
              file=sys.stderr)
        sys.exit(NO_COMPILER_API)
    launches = []
    originals = {name: getattr(ta, name) for name in KERNELS}
    for name, kernel in originals.items():
        setattr(ta, name, Recorder(name, kernel, launches))
    try:
        cases()
    finally:
        for name, kernel in originals.items():
            setattr(ta, name, kernel)
    results = []
    for name, kernel, args, kwargs in launches:
        consts = {k: str(v) for k, v in kwargs.items()}
        try:
            text = lower(kernel, args, kwargs)
        except Exception as e:  # a compilation error: report it with the launch
            results.append(dict(kernel=name, constexprs=consts, error=f"{type(e).__name__}: {e}"[-600:]))
            continue
        results.append(dict(kernel=name, constexprs=consts, error=None, cache_offsets=offset_types(text)))
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main()
