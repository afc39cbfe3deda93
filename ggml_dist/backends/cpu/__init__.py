"""The CPU backend (ggml-cpu): host buffers, one kernel per op, ggml's numerics bit for bit.

The numpy reference path (imports no numba; GGML_DIST_NO_NUMBA=1 runs it alone):
    backend.py      CPUDevice / CPUBufferType / CPUBuffer / CPUBackend, binding a graph once, replay
    ops.py          ComputeOptions, the op kernels on strided numpy views, dispatch to the compiled twins
    blocks.py       the block formats, one table: fields and offsets, vec_dot type, the kernels that take each
    quants.py       the block formats' decode / quantize and MUL_MAT in numpy (ggml-quants.c, vec_dot orders)
    numerics.py     ggml's float helpers (fma, vectorised exp, f16 rounding)
    rope.py         ROPE (ggml's rope cache, the C library's cosf/sinf)
    reference.py    the plain reference executor: the oracle for the allocator and the scheduler

The numba path (the compiled twins, same bits):
    threads.py          the kernels' thread count and launch lock (the one thread API)
    kernel_cache.py     where numba caches the kernels, stamped with every module of this package
    compile_progress.py the progress line while kernels compile
    entry.py            a kernel's overload chosen once at bind time, called through its entry point
    fkernels.py         float ops (norms, softmax, rope, attention products, f16/f32 MUL_MAT)
    qkernels.py         MUL_MAT on quantized weights in their GGUF blocks (every type, decode per call)
    qpack.py            Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/MXFP4 repacked into 64-row groups, float and int8 kernels
    kpack.py            Q4_K/Q5_K/Q6_K repacked into 64-row groups of superblocks, int8 kernels
    experts.py          MUL_MAT_ID on 3-D expert weights packed once (qpack/kpack layouts), one call per step
    moe_ops.py          a MoE layer's router ops and weighted sum as single calls (fusion.py binds them)
    vnni.py, avx2.py    the int8 group kernels of qpack as LLVM IR (AVX-512 VNNI, AVX2)
    kquant_ir.py        the int8 group kernels of kpack as LLVM IR (both ISAs)
"""
