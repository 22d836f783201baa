"""Capture: the probes that watch a slice of the user's loop, the Recorder they write to,
the slice itself (``Profile``, ``profile``, ``profile_fn``) and ``build`` (Recorder -> Run).

A probe never draws and never analyses; it appends small tuples to the Recorder.
"""
