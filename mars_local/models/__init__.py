"""Which models to load: the registry (models.yaml, bundled and the user's) and downloads.

Owns registry lookup and model/drafter resolution (:mod:`.registry`) and hub downloads
(:mod:`.hub`).  May import: :mod:`mars_local.core`.
"""
