"""Device staging: how one step's metadata fields get from the host to the device.

The rule: a persistent host buffer may be read by synchronous CPU readers, but
the source of every ``non_blocking`` host-to-device copy is a private host snapshot that no
later step writes while the copy may still be queued. With an overlap scheduler the host
prepares step t+1 while step t's copy is in flight; a copy that read a persistent buffer
would pick up step t+1's values.

One step, in order (each backend's ``_prepare_backend``)::

    host = arena.begin(end)        # private int32 snapshot of the arena prefix [0, end)
    arena.put(host, name, values)  # per-row facts written at each field's fixed offset
    arena.commit()                 # ONE non_blocking copy of the prefix
    expander.launch(n, args)       # optional: one kernel expands per-token / per-page
                                   # fields from the per-row facts, in stream order

Modules:

* ``arena``        -- ``DeviceArena``: named int32 fields at fixed offsets of one device
  allocation (addresses never move, so CUDA graphs may record them); ``to_device``,
  ``host_empty``, ``copy_to``, ``use_pinned``.
* ``pinned_ring``  -- ``PinnedRing``: the arena's snapshots on a GPU, pinned buffers reused
  only after the copy that read them completed (CUDA events), copied through the CUDA
  runtime; torch's pinned snapshot when the ring is busy or a graph is capturing.
* ``expand``       -- ``DeviceExpander``: launches ``_expand_kernel.expand_step_kernel``
  (slots, positions, batch indices, the ragged page list) over the arena's buffer.
"""

from kvplan.backends.staging.arena import (
    DeviceArena,
    copy_to,
    host_empty,
    to_device,
    use_pinned,
)
from kvplan.backends.staging.expand import DeviceExpander, expand_on_device_default
from kvplan.backends.staging.pinned_ring import PinnedRing, cudart

__all__ = [
    "DeviceArena",
    "DeviceExpander",
    "PinnedRing",
    "copy_to",
    "cudart",
    "expand_on_device_default",
    "host_empty",
    "to_device",
    "use_pinned",
]
