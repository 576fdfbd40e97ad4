"""Fault injection (a feature): inject one fault, seeded chaos schedules, fault specs.

``worker`` runs inside each proc (a plugin: the in-proc faults); the rest runs on the controller.

May import: the core (``actor``, ``supervision``, ``transport``, ``config``, ``errors``,
``device``) and ``runtime``. Never another feature.
"""
