"""Supervision as data: proc states and records, typed events, policies, the supervision tree.

The runtime writes these records and events and carries out the policies' decisions; widgets,
the debugger and training read them.

May import: ``transport`` (routing ids), ``config``, ``errors``. Never ``actor``, ``runtime`` or
a feature.
"""
