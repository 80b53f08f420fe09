"""The pure core: numpy and the standard library only, no llama.cpp, no I/O beyond reading a user's file.

Owns the verification rules and their glossary (:mod:`.verify`), the sampling pipeline
(:mod:`.sampling`), the one table of defaults and ranges (:mod:`.defaults`) and
:class:`GenerateConfig`, which reads it (:mod:`.config`), the statistics dataclass
(:mod:`.stats`), the names of choices (:mod:`.choices`), :class:`MarsError` (:mod:`.errors`),
token helpers (:mod:`.tokens`) and bounded reading of user files (:mod:`.textfile`).  May import: nothing else of mars_local.
"""
