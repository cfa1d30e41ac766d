"""How ranks first meet, before they have sockets to each other: the stores
(:mod:`.store`, :mod:`.tcpstore`, a torch store adapter), the init methods that
turn a URL into ``(store, rank, world_size)`` (:mod:`.init_methods`, behind
``nc.rendezvous``), and what a launcher's environment says (:mod:`.launcher_env`).

(Not named ``rendezvous``: that name is the public function ``nc.rendezvous``.)"""
