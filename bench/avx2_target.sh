#!/bin/bash
# Runs a command as a CPU without AVX-512 would: numba compiles for Haswell with AVX-512 off
# (its own cache, so the host's kernels stay), OpenBLAS takes its Haswell kernels, FAISS its
# AVX2 build. hnswlib picks its instructions itself. docs/ann.md has what it measured.
#   bench/avx2_target.sh python -m bench.serving --model DIR ...
export NUMBA_CPU_NAME=haswell
export NUMBA_CPU_FEATURES="+64bit,+avx,+avx2,+bmi,+bmi2,+cmov,+cx16,+cx8,+f16c,+fma,+fsgsbase,+fxsr,+lzcnt,+mmx,+movbe,+pclmul,+popcnt,+rdrnd,+sahf,+sse,+sse2,+sse3,+sse4.1,+sse4.2,+ssse3,+xsave,+xsaveopt,-avx512f,-avx512bw,-avx512dq,-avx512vl,-avx512cd,-avx512vnni,-avx512bf16,-avx512vbmi,-avx512vbmi2,-avx512bitalg,-avx512vpopcntdq,-avx512ifma,-avxvnni"
export NUMBA_CACHE_DIR="${NUMBA_CACHE_DIR:-${TMPDIR:-/tmp}/slide-numba-avx2}"
export OPENBLAS_CORETYPE=Haswell
export FAISS_OPT_LEVEL=avx2
exec "$@"
