"""The engine's model on disk: :class:`Persistence`, the ``save`` / ``load`` half of
:class:`slide.estimator.SlideClassifier`, through :mod:`slide.checkpoint` (npz + JSON, atomic,
no pickle) and, for a model sharded by label, :mod:`slide.shards`' manifest."""
from __future__ import annotations

import os

import numpy as np

from slide.candidates import ClusterCandidates
from slide.checkpoint import CheckpointError, read_checkpoint, write_checkpoint
from slide.config import parameter_shapes
from slide.labels import LabelMap
from slide.loop import FitRecord
from slide.serving import Server
from slide.shards import ShardPlace, is_sharded, read_manifest
from slide.step import TrainingState

__all__ = ["Persistence"]


class Persistence:
    """``save`` and ``load`` of a :class:`slide.estimator.SlideClassifier`."""

    def save(self, path, inference_only: bool = False) -> None:
        """Write the model to directory ``path`` (npz + JSON, atomic; see :mod:`slide.checkpoint`).

        ``inference_only`` leaves out what only training needs (the Adam moments and the best
        epoch's copy): about a third of the size; such a model predicts, but cannot resume.
        """
        self._require_fitted()
        if self.shards() is not None:  # every rank its shard, then the manifest
            self.shards().save(self, path, lambda where: self._write(where, inference_only))
            return
        self._write(path, inference_only)

    def _write(self, path, inference_only: bool) -> None:
        """:meth:`save` of this process's model (one label shard's, where it is one)."""
        pre_arrays, pre_meta = self.preprocessor_.get_state()
        best, record = self.record_.to_checkpoint()
        arrays = {**self.params_, **{f"pre.{k}": v for k, v in pre_arrays.items()},
                  "labels": self.labels_.ids}
        if self.log_prior_ is not None:
            arrays["log_prior"] = self.log_prior_
        if self.held_out_ is not None:
            arrays.update({f"held_out.{k}": getattr(self.held_out_, k)
                           for k in ("data", "indices", "indptr")})
        if not inference_only:
            arrays.update({f"adam.{k}": v for k, v in self.moments_.items()}, **best)
            if isinstance(self.state_.tables, ClusterCandidates):  # resumed in its clusters
                arrays.update(self.state_.tables.arrays())
        meta = {
            "engine": "slide", "config": self.config_.to_json(), "preprocessing": pre_meta,
            "n_features": self.n_features_in_, "n_labels": self.n_labels_, "n_train": self.n_train_,
            "rare_share": self.rare_share_, "choice": self.choice_,
            "labels_per_row": self.labels_per_row_, "n_outputs_fitted": self.n_outputs_fitted_,
            "slow_rows": self.slow_rows_kept_,
            "features_per_row": self.features_per_row_,
            **self.state_.counters(), **record,
            "inference_only": bool(inference_only),
        }
        if self.shards() is not None:
            meta["label_shard"] = {"index": self.shards().rank, "count": self.shards().size}
        write_checkpoint(path, arrays, meta, self.step_)

    @classmethod
    def load(cls, path, shards=None) -> "Persistence":
        """Load a model saved by :meth:`save`, or by the dense reference (same format). A
        label-sharded checkpoint (:mod:`slide.shards`) loads whole into this process, its
        shards' output rows side by side; ``shards``: a
        :class:`slide.shards.LabelShards` on as many ranks as the checkpoint has shards, each
        rank then loading its own (``LabelShards.load``) to train on or to serve."""
        if shards is None and is_sharded(path):
            return cls._load_merged(path)
        ck = read_checkpoint(path)
        part = ck.meta.get("label_shard")
        if (part is None) != (shards is None):
            raise CheckpointError(
                f"{path}: " + ("one shard of a label-sharded checkpoint: load its parent "
                               "directory" if shards is None else
                               "not a shard of a label-sharded checkpoint"))
        if shards is not None and (part.get("index"), part.get("count")) != (shards.rank, shards.size):
            raise CheckpointError(f"{path}: shard {part.get('index')} of {part.get('count')}, "
                                  f"loaded by rank {shards.rank} of {shards.size}")
        model = cls(**ck.config_params(cls))
        model.read_fitted(ck, shards)
        model.inference_only_ = bool(ck.meta.get("inference_only", False))
        model.state_ = TrainingState.from_checkpoint(ck, model.config_, model.resolved_)
        model.state_.bias_shift = model.prior_shift()
        model.server_ = Server(model.state_)
        held_out = ck.held_out(model.n_features_in_)
        if held_out is not None:  # checked as any input is
            model.held_out_ = model.check_data(held_out, where=f"{ck.npz_path}: held-out rows")
        model.record_ = FitRecord.from_checkpoint(
            ck, parameter_shapes(model.resolved_["hidden"], ck.n_features, ck.labels.size))
        return model

    @classmethod
    def _load_merged(cls, path) -> "Persistence":
        """One model from the shards of a label-sharded checkpoint: the hidden layers, settings
        and record of the first, every shard's output rows (weights, moments, best weights,
        labels and priors) in shard order."""
        manifest = read_manifest(path)
        n = len(manifest["shards"])
        parts = [cls.load(os.path.join(os.fspath(path), *name.split("/")), shards=ShardPlace(i, n))
                 for i, name in enumerate(manifest["shards"])]
        model = parts[0]
        model.label_shards_ = None
        model.labels_ = LabelMap(np.concatenate([m.labels_.ids for m in parts]), model.n_labels_)
        if model.log_prior_ is not None:
            model.log_prior_ = np.concatenate([m.log_prior_ for m in parts])
        model.resolved_ = model._resolve(model.config_)
        rows = lambda arrays, names: {k: np.concatenate([np.asarray(m[k]) for m in arrays])  # noqa: E731
                                      if k in names else np.array(arrays[0][k]) for k in arrays[0]}
        params = rows([m.state_.params for m in parts], ("W", "b"))
        moments = rows([m.state_.moments for m in parts], ("W.m", "W.v", "b.m", "b.v"))
        state = TrainingState(model.config_, model.resolved_, model.n_features_in_,
                              model.labels_.size, params, moments, model.state_.counters())
        best = [m.record_.best_params for m in parts]
        model.record_.best_params = None if any(b is None for b in best) else rows(best, ("W", "b"))
        del parts[1:], best
        state.row_blocks()
        state.refresh_tables()
        model.state_ = state
        model.state_.bias_shift = model.prior_shift()
        model.server_ = Server(model.state_)
        return model
