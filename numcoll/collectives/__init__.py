"""The collectives of :class:`numcoll.ProcessGroup`, grouped by kind: each
method checks its arguments with Gloo's wording, then queues a closure that
runs an algorithm from :mod:`numcoll.algorithms` on work buffers."""
