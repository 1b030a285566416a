"""slide: sub-linear extreme-classification training on multicore CPUs."""
import lsh  # noqa: F401  (configures numba's threading layer before any kernel runs)
from slide.config import SlideConfig
from slide.data import DataFormatError, read_dataset, read_libsvm, read_xmc
from slide.metrics import evaluate, ndcg_at_k, precision_at_k, psp_at_k
from slide.network import SlideClassifier
from slide.preprocess import Preprocessor
from slide.synthetic import make_dataset

__version__ = "0.2.0"
__all__ = ["SlideClassifier", "SlideConfig", "Preprocessor", "DataFormatError", "make_dataset",
           "read_dataset", "read_xmc", "read_libsvm", "evaluate", "precision_at_k", "ndcg_at_k",
           "psp_at_k"]
