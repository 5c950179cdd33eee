"""The byte budget of the file backend. `ProcessBudget` (process.py) is the one owner of the
capacity: it reads `TierConfig.capacity_bytes` once; the index, the shared budget and the ledger ask it.

process.py       this process's budget: reservations, the free-space watermark, LRU eviction, unlinks
index.py         the LRU index of our extents: pins, byte accounting, victims
shared.py        the root's half: leases from the ledger, evicting others' extents, `Tier.shared`
ledger.py        the root's budget, shared by all its processes (a ledger file under a POSIX lock)
ledger_state.py  the ledger's content (State, leases) and what a reservation returns and calls back
mark.py          ProcessMark: is another process on this root now? (a lock held per process)
filelock.py      the lock: private open, probe (local-only NFS locks too), wait with a deadline
"""
