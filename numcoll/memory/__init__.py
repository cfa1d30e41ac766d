"""Arrays as collectives see them: what the caller passed turned into arrays
and checked (:mod:`.arrays`), the host memory a collective works in
(:mod:`.host`, the twin of :mod:`numcoll.cuda.memory`), the (op, dtype) plan
of a reduction (:mod:`.reduction`) and sparse arrays (:mod:`.sparse`)."""
