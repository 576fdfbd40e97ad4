"""The notebook (a feature): ``%mesh`` / ``%%mesh`` magics, widgets, the kernelspec.

``worker`` (the ``%%mesh`` cell executor actor) runs inside each proc; the rest runs in the
kernel. Nothing here is imported by ``import monarch_nb``; ``%load_ext monarch_nb`` loads it.

May import: the core, ``runtime`` and the other features (``train``, ``debug``, ``faults``).
"""
