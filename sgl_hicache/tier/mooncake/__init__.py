"""The Mooncake backend: extents as objects of a Mooncake Store (`backend.MooncakeTier`).

backend.py     MooncakeTier: submit/complete, store, remove, purge and lookup jobs, warm start
load.py        a load's jobs: the header, then layer group by layer group (a batch's group 0 first)
failures.py    what a failed job leaves: its status, a bad extent's header removed
objects.py     one extent as Mooncake objects (the file format, cut at its seams), written and verified
client.py      the Mooncake client: setup, batch calls, object names (a directory per salt), result codes
manifest.py    the records of which extents a namespace's writers stored (warm start), compacted
warm_start.py  a tier's open: the manifest's extents verified and indexed, the rest counted
purge.py       a purge by cache_salt: one remove_by_regex, retried until the store does it
source.py      lookups over the store (path_lookup.py's walk, aliases as objects)
recent.py      the bounded index of a tier that cannot list its store, with each key's salt tag
"""
