"""Analysis: pure functions from the Run's frames to frames and small summaries.

``steps`` (shares, verdicts, the summary), ``memory``, ``clocks``, ``stats`` and ``compare``,
``recommend``, ``loader``, ``ranks``, ``tuning``, ``catalog`` (the run store as a table).
Nothing here measures or draws, and nothing imports capture or views.
"""
