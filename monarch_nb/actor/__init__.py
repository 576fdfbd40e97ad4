"""The client-side actor model: Actor, @endpoint, meshes, ValueMesh, Future, slicing.

What a user's code touches (re-exported by ``monarch_nb``). It reaches processes only through
the :class:`~monarch_nb.actor.backend.Backend` Protocol that the runtime implements and installs.

May import: ``supervision``, ``transport``, ``config``, ``errors``. Never ``runtime`` or a feature.
"""
