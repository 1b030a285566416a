"""slide: sub-linear extreme-classification training on multicore CPUs.

The public names load on first use, so that ``import slide.runtime`` (which :mod:`lsh` does)
loads nothing else, and importing the package configures nothing.
"""
import importlib

__version__ = "0.2.0"

#: public name: the submodule that defines it
_PUBLIC = {
    "SlideClassifier": "estimator", "SlideConfig": "config", "Preprocessor": "preprocess",
    "DataFormatError": "data", "read_dataset": "data", "read_xmc": "data", "read_libsvm": "data",
    "make_dataset": "synthetic", "evaluate": "metrics", "precision_at_k": "metrics",
    "ndcg_at_k": "metrics", "psp_at_k": "metrics",
}
__all__ = list(_PUBLIC)


def __getattr__(name):
    if name in _PUBLIC:
        return getattr(importlib.import_module(f"{__name__}.{_PUBLIC[name]}"), name)
    raise AttributeError(f"module 'slide' has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *_PUBLIC])
