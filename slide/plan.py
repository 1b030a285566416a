"""A way of running the engine, as one object: :class:`Plan`.

A plan says where the work runs (CPU threads per process, MPI ranks per host and hosts, a GPU
worker and its policy), how the asynchronous groups average (``mode``, ``every``,
``delay``) and the optimizer's settings that go with that choice (batch size, learning rate,
Adam's ``beta1``, the planned epochs). Every way of running ``slide train`` is a plan; the
defaults are :meth:`Plan.default`. :mod:`slide.planner` measures and chooses among plans.
"""
from __future__ import annotations

import shlex
from dataclasses import asdict, dataclass, fields, replace

__all__ = ["Plan", "GPU_WORKERS", "AVERAGING"]

#: the GPU's roles: alone (the dense reference's sampled softmax) or beside the CPU threads
#: (:class:`gpu_ref.hetero.HeteroTrainer`'s two policies)
GPU_WORKERS = ("alone", "hogbatch", "adaptive")
#: how ranks combine their work (:class:`slide.distributed.DataParallel`'s modes)
AVERAGING = ("sync", "local", "delayed")


@dataclass(frozen=True)
class Plan:
    """One way of running a training job.

    threads : numba threads per process (None: the host's cores over its ranks).
    ranks, hosts : MPI processes per host and hosts (1, 1: one process, no MPI).
    mode, every, delay : how ranks average (:class:`slide.distributed.DataParallel`); ignored
        with one rank.
    gpu : None (CPU only), or the GPU's role (:data:`GPU_WORKERS`); how the heterogeneous
        trainer shares the work is its policy's (:class:`gpu_ref.hetero.HeteroConfig`).
    batch_size, lr, epochs : the engine's settings (None: the defaults rule's).
    beta1 : Adam's first-moment decay, the explicit momentum.
    """
    threads: int | None = None
    ranks: int = 1
    hosts: int = 1
    mode: str = "sync"
    every: int | None = None
    delay: int | None = None
    gpu: str | None = None
    batch_size: int | None = None
    lr: float | None = None
    beta1: float = 0.9
    epochs: int | None = None

    def __post_init__(self):
        for name in ("ranks", "hosts"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if self.mode not in AVERAGING:
            raise ValueError(f"mode must be one of {', '.join(AVERAGING)}, got {self.mode!r}")
        if self.gpu is not None and self.gpu not in GPU_WORKERS:
            raise ValueError(f"gpu must be None or one of {', '.join(GPU_WORKERS)}, got {self.gpu!r}")
        if self.gpu is not None and self.processes > 1:
            raise ValueError("a GPU worker runs beside one process's threads (ranks=hosts=1)")
        if not 0 <= self.beta1 < 1:
            raise ValueError(f"beta1 must be in [0, 1), got {self.beta1!r}")

    # -- what it is --------------------------------------------------------------------------
    @property
    def processes(self) -> int:
        return self.ranks * self.hosts

    @property
    def groups(self) -> int:
        """Asynchronous groups: processes that update the model without waiting for each
        other between averages (``sync`` ranks act as one group)."""
        return 1 if self.mode == "sync" else self.processes

    @classmethod
    def default(cls) -> "Plan":
        """What ``slide train`` runs without a plan: one process on every core, the rule's
        settings."""
        return cls()

    @classmethod
    def of(cls, params: dict) -> "Plan":
        """The one-process plan of an engine's constructor settings (``get_params()``)."""
        return cls(threads=params.get("threads"), batch_size=params.get("batch_size"),
                   lr=params.get("lr"), beta1=float(params.get("beta1", 0.9)),
                   epochs=params.get("epochs"))

    @property
    def name(self) -> str:
        """A short description: what differs from :meth:`default`."""
        return self.describe()

    def describe(self, base: "Plan | None" = None) -> str:
        """What differs from ``base`` (default: :meth:`default`), or "default"."""
        d = base or Plan.default()
        parts = []
        if self.processes > 1:
            parts.append(f"{self.ranks}x{self.hosts} ranks {self.mode}"
                         + (f"/{self.every}" if self.every else ""))
        if self.gpu:
            parts.append(f"gpu {self.gpu}")
        for f in ("threads", "batch_size", "lr", "beta1", "epochs"):
            v = getattr(self, f)
            if v != getattr(d, f):
                parts.append(f"{f}={v:g}" if isinstance(v, float) else f"{f}={v}")
        return ", ".join(parts) or "default"

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, doc: dict) -> "Plan":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(doc) - known)
        if unknown:
            raise ValueError(f"a plan has no setting {', '.join(unknown)}")
        return cls(**doc)

    def but(self, **changes) -> "Plan":
        return replace(self, **changes)

    # -- how to run it -----------------------------------------------------------------------
    def params(self) -> dict:
        """The engine's constructor settings this plan sets (None: the rule's)."""
        return {"threads": self.threads, "batch_size": self.batch_size, "lr": self.lr,
                "beta1": self.beta1, "epochs": self.epochs}

    def argv(self) -> list[str]:
        """``slide train``'s options for this plan, after the launcher (:meth:`launcher`)."""
        out = []
        for flag, v in (("--threads", self.threads), ("--batch-size", self.batch_size),
                        ("--lr", self.lr), ("--epochs", self.epochs)):
            if v is not None:
                out += [flag, repr(v) if isinstance(v, float) else str(v)]
        if self.beta1 != Plan.beta1:
            out += ["--beta1", repr(self.beta1)]
        if self.processes > 1:
            out += ["--distributed", self.mode]
            if self.every:
                out += ["--average-every", str(self.every)]
            if self.delay:
                out += ["--delay", str(self.delay)]
        if self.gpu == "alone":
            out += ["--engine", "dense", "--device", "gpu"]
        elif self.gpu:
            out += ["--mode", "hetero", "--policy", self.gpu]
        return out

    def launcher(self) -> list[str]:
        """The command that starts the plan's processes (empty: one process, no launcher)."""
        if self.processes == 1:
            return []
        cmd = ["mpiexec", "-n", str(self.processes)]
        if self.hosts > 1:
            cmd += ["-ppn", str(self.ranks)]
        return cmd

    def command(self, train: str, *extra: str) -> str:
        """The shell command that runs this plan on training file ``train``."""
        return shlex.join(self.launcher() + ["slide", "train", train, *self.argv(), *extra])
