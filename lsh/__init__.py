"""Locality-sensitive hash families and hash tables as parallel numba kernels."""
from lsh._threading import (blas_threads, configure_threading_layer, engine_threads, set_num_threads,
                            thread_chunks)

configure_threading_layer()

from lsh.arrays import aligned_empty, aligned_zeros, as_rows  # noqa: E402
from lsh.compact import CompactTables  # noqa: E402
from lsh.families import DWTA, WTA, SimHash, make_family  # noqa: E402
from lsh.tables import HashTables, TableConfig, autotune  # noqa: E402

__all__ = ["SimHash", "WTA", "DWTA", "make_family", "HashTables", "CompactTables", "TableConfig",
           "autotune", "set_num_threads", "engine_threads", "blas_threads", "thread_chunks",
           "as_rows", "aligned_empty", "aligned_zeros"]
