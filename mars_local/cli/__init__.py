"""The `mars` command line: parse flags and render; the work is in the packages beside it.

:mod:`.main` defines the app and `mars run`; one module per command (:mod:`.chat`,
:mod:`.batch`, :mod:`.serve`, :mod:`.bench`, :mod:`.models`); :mod:`.flags` holds the shared
options (their defaults and ranges are core.defaults') and names a setting's error by the flag
typed; :mod:`.inputs` reads files named by flags and opens the engine; :mod:`.render` shows
chunks and statistics; :mod:`.typed` is what the user typed (the command line, text made valid
UTF-8).  Imports go one way: main and the commands -> flags -> inputs -> typed.  May import anything
of mars_local; nothing imports it (except ``python -m mars_local``).
"""
