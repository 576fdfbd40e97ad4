"""What the :class:`~.trainer.Trainer`'s rooms share: the fields they read, declared in one place.

A Trainer is one actor built from rooms that each own a concern: joining quorums
(:class:`~.trainer_quorum.QuorumEndpoints`), moving state (:class:`~.trainer_state.StateEndpoints`),
the step (:class:`~.trainer_step.Stepping`) and the loop (:class:`~.trainer.Trainer` itself). Each
field is set where its docstring says; they are read and written on the actor's thread and the
training function's loop thread, which take turns (see :mod:`.trainer_loop`), never both at once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from .quorum_watch import QuorumWatch
    from .sharding import GroupLayout

__all__ = ["TrainerFields"]


class TrainerFields:
    """The Trainer's shared fields (see the module docstring)."""

    # set by Trainer.__init__ (every proc, at once)
    rank: int  #: this replica's global rank
    layout: "GroupLayout"  #: the replica groups
    collective_timeout_s: float  #: timeout of rendezvous and collectives, seconds
    store_host: str  #: the controller's rendezvous TCPStore
    store_port: int
    chunk_bytes: int  #: largest piece of state per heal message, bytes
    _group_generation: int  #: the incarnation of this rank's replica group (sharded runs)
    _sharded: bool = False  #: the model is split inside a replica group (see .sharding)
    watch: "QuorumWatch"  #: the quorum's members and the first said dead (collectives give up on it)
    # set by Trainer.setup
    backend: str  #: "gloo" or "nccl"
    device: "torch.device"
    _world: int = 0  #: the quorum's size
    _ranks: list[int] = []  #: the quorum's proc ranks (set by init_quorum)
    _step_ms_avg: float | None = None  #: the running mean of a step's time, milliseconds
    # set by Stepping._adopt (ft.wrap)
    model: Any = None
    optimizer: Any = None
    registered: dict[str, Any] = {}  #: name -> what ft.register gave (schedulers, ...)
    next_step = 0  #: the step whose update comes next

    # -- implemented by the rooms, for the others ------------------------------------------------------
    def _leave_group(self) -> None:
        """Tear down the quorum's process group (QuorumEndpoints)."""
        raise NotImplementedError

    def _forget_attempt(self) -> None:
        """Drop the kept start state of the step being tried (Stepping)."""
        raise NotImplementedError
