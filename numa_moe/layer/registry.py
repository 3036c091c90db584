"""The live layers by id: custom ops take tensors and scalars only, so the torch op
(``numa_moe.layer.op``) finds its layer here by ``MoELayer.layer_id``. Neither the op nor
the layer imports the other's internals; both import this."""

from __future__ import annotations

import itertools
import weakref

__all__ = ["register", "get_layer", "live_layers"]

_layer_ids = itertools.count(1)
# Held weakly: a layer nobody holds is gone, its id with it.
_layers: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def register(layer) -> int:
    """Registers a layer and returns its id (never reused in this process)."""
    layer_id = next(_layer_ids)
    _layers[layer_id] = layer
    return layer_id


def get_layer(layer_id: int):
    """The live layer with this id; ValueError when there is none."""
    layer = _layers.get(int(layer_id))
    if layer is None:
        raise ValueError(f"no live MoELayer with id {layer_id}")
    return layer


def live_layers() -> list:
    """Every layer alive now."""
    return list(_layers.values())
