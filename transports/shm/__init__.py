"""The shared-memory transport ``shm``: lock-free rings between the processes
of one Linux host (:mod:`.transport`; the ring itself in :mod:`.ring`). How ranks
connect and who is let in (:mod:`.rendezvous`), the sealed memory file each rank
owns (:mod:`.region`), who moves the bytes (:mod:`.progress`), and the shared
arena the collectives meet in (:mod:`.arena`)."""
