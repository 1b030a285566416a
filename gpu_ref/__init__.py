"""Dense reference training on cupy (GPU) or numpy (CPU), and CPU+GPU co-training."""
from gpu_ref.dense import DenseClassifier, get_array_module, gpu_available

__all__ = ["DenseClassifier", "get_array_module", "gpu_available"]
