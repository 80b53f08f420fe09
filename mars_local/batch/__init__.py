"""`mars batch` as a library: JSONL jobs in, one marked record per job out, resumable.

Owns reading jobs, the output file's lock and marks, and running jobs over an engine
(:mod:`.jobs`).  May import: :mod:`mars_local.core`, :mod:`mars_local.chat`,
:mod:`mars_local.speculate` (grammars).
"""
