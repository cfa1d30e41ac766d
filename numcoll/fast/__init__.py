"""Small collectives at the hardware's pace: repeated calls as one compiled step.

- :mod:`.step`: :class:`FusedCall`, one small call of a group planned once
  and run as one fused arena step, and how the group takes it back
  (promotion) when anything else happens meanwhile;
- :mod:`.request`: persistent requests whose start and wait are one
  compiled call each;
- :mod:`.repeat`: blocking calls recognised as repeats of a recent one;
- :mod:`.forms`: small allreduce, reduce, broadcast, allgather (both
  forms), reduce_scatter_tensor, all_to_all (both forms), gather and
  scatter calls on new arrays each time, run through a plan per form;
- :mod:`.moves`: the plans of the data-moving ones (allgather, gather,
  scatter, alltoall, reduce_scatter) as tables of copies.
"""

from .repeat import Repeats, fusable
from .request import FusedRequest, Started, fused_request, make_request
from .step import FusedCall, promote, settle, take_back, update_blocked

__all__ = ["FusedCall", "FusedRequest", "Repeats", "Started", "fusable", "fused_request",
           "make_request", "promote", "settle", "take_back", "update_blocked"]
