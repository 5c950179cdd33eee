"""The Mooncake backend: extents as objects of a Mooncake Store (`backend.MooncakeTier`).

backend.py   MooncakeTier: submit/complete, store, load, remove and lookup jobs
objects.py   one extent as Mooncake objects (the file format, cut at its seams), written and verified
client.py    the Mooncake client: setup, object names, result codes
source.py    lookups over the store (path_lookup.py's walk, aliases as objects)
recent.py    the bounded index of a tier that cannot list its store
"""
