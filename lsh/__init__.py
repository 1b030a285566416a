"""Locality-sensitive hash families and hash tables as parallel numba kernels.

Importing this package configures nothing: numba's threading layer is chosen by
:func:`slide.runtime.configure_threading` before the first parallel kernel.
"""
from lsh.compact import CompactTables
from lsh.families import DWTA, WTA, SimHash, make_family
from lsh.tables import HashTables, TableConfig, autotune

__all__ = ["SimHash", "WTA", "DWTA", "make_family", "HashTables", "CompactTables", "TableConfig",
           "autotune"]
