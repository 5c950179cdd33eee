"""The file backend: extents as files of a directory shared by the servers mounting it (`backend.FileTier`).

backend.py     FileTier: submit/complete, store and load jobs
paths.py       fan-out file layout, temp names, free space
store.py       write one extent (temp file, checksummed chunks, header, fsync, rename)
load.py        open and verify one extent, read and verify its chunks
publish.py     a store's file half: "present" (adopting others' files), write + account outcome
recreate.py    a directory removed while serving: re-created, secret written back
scan.py        startup index rebuild      integrity.py  check_integrity against the files
sweep.py       stat-only walk of the whole root, accounted unlinks   owner.py  writer identity
aliases.py     path-key alias links: publish, read, remove dangling  source.py  lookups over them
retain.py      pins, drops and purges for the retention hints   purge.py  salt tags, purged namespaces
volume.py      is the volume larger than the free-space watermark plus a useful capacity?
budget/        the byte budget: this process's and the root's, shared by all its processes
"""
