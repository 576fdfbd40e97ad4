"""Processes: the controller, the host agent, the worker core, and the contract between them.

Where each module runs: ``proc`` inside every worker proc (composed with the features' worker
plugins by ``monarch_nb.proc_main``); ``host_agent`` in each host agent process; everything else
(``controller``, ``launch``, ``liveness``, ``supervisor``, ``messenger``, ``output``,
``rendezvous``) in the controller — the notebook kernel or script. ``protocol`` is shared by all
three: message kinds, the fault catalogue, the worker environment.

Implements :class:`monarch_nb.actor.backend.Backend`. May import ``actor``, ``supervision``,
``transport``, ``config``, ``errors``, ``device``; never a feature (faults, debug, train, jupyter).
"""
