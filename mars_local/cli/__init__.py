"""The `mars` command line: parse flags and render; the work is in the packages beside it.

:mod:`.main` defines the app and `mars run`; one module per command (:mod:`.chat`,
:mod:`.batch`, :mod:`.serve`, :mod:`.bench`, :mod:`.models`); :mod:`.flags` holds the shared
options, :mod:`.inputs` reads files named by flags and opens the engine.  May import anything
of mars_local; nothing imports it (except ``python -m mars_local``).
"""
