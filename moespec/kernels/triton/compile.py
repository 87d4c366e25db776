"""Compiling planned launches for a GPU without one: a check that the kernels build for the card.

Triton compiles to a cubin for any NVIDIA architecture on a machine without a GPU (it ships its
own ptxas), so a CPU machine can catch what the interpreter cannot: type, layout and resource
errors of the real compile. Arguments are specialised as Triton does on a launch: integers equal
to 1 become constants, and pointers and integers divisible by 16 are marked so.
"""

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from moespec.kernels.triton.launch import Launch

_POINTER_TYPES = {
    torch.bfloat16: "*bf16",
    torch.float16: "*fp16",
    torch.float32: "*fp32",
    torch.int64: "*i64",
    torch.int32: "*i32",
}
_OPTIONS = ("num_warps", "num_stages")


def _specialize(names, args, meta):
    signature, constexprs, attrs = {}, {}, {}
    for index, (name, arg) in enumerate(zip(names, args, strict=False)):
        if isinstance(arg, torch.Tensor):
            signature[name] = _POINTER_TYPES[arg.dtype]
            aligned = arg.data_ptr() % 16 == 0
        elif arg == 1:
            signature[name], constexprs[name] = "constexpr", 1
            continue
        else:
            signature[name] = "i32" if -(2**31) <= arg < 2**31 else "i64"
            aligned = arg % 16 == 0
        if aligned:
            attrs[(index,)] = [["tt.divisibility", 16]]
    for name in names[len(args) :]:
        signature[name], constexprs[name] = "constexpr", meta[name]
    return signature, constexprs, attrs


def compile_launch(launch: Launch, arch: int = 90):
    """Compile one planned launch for sm_<arch>; returns Triton's compiled kernel."""
    fn = launch.kernel
    if not hasattr(fn, "arg_names"):
        raise TypeError("compile_launch needs a compiled (not interpreted) Triton kernel")
    signature, constexprs, attrs = _specialize(fn.arg_names, launch.args, launch.meta)
    options = {name: launch.meta[name] for name in _OPTIONS if name in launch.meta}
    source = ASTSource(fn, signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)
