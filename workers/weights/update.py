"""How one version of the policy's weights travels to a rollout engine: the weight-update
descriptor every sender and receiver takes.

An update is one of three things, and says which:

- :class:`FileWeights`: a safetensors file on the receiving host, read by path. With an
  identity (device, inode) the reader reads only the file that was checked
  (files.held_weight_file). ``adapter``: the file is a LoRA adapter (model.lora: PEFT's
  config in its header, files.ADAPTER_CONFIG_KEY), loaded into the engine's adapter slot
  instead of over the model's weights. An engine server on another host gets the file as
  a stream of bounded chunks (files.chunk_bytes) that it spools to a file of its own, and
  then holds a ``FileWeights`` of that file; one on this host takes the trainer's file by
  its path (rollout/client.py decides which).
- :class:`InlineWeights`: safetensors bytes inside the message (small models, tests).
- :class:`BroadcastWeights`: one collective broadcast of the trainer's weight group
  (weights/broadcast.py): the metadata each engine's receive needs and the barrier every
  engine passes right before it receives.

The choice between them is made once, where the update is consumed: the engine's load
(rollout/engine.py), the client's send (rollout/client.py) and the server's receive
(rollout/server.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, Union

from workers.weights.files import ADAPTER_CONFIG_KEY, WeightFile, weight_file_metadata


@dataclass(frozen=True)
class FileWeights:
    """A safetensors file on the receiving host (its tensors by the trainer's names)."""
    file: WeightFile
    adapter: bool = False  # model.lora: a LoRA adapter, its PEFT config in the file's header

    @classmethod
    def of(cls, file: WeightFile) -> "FileWeights":
        """The update that ``file`` is: an adapter when its header carries an adapter config
        (reads the header only, and only the file that was checked when it has an identity)."""
        return cls(file, ADAPTER_CONFIG_KEY in weight_file_metadata(file))

    @property
    def size(self) -> int:
        return self.file.size


@dataclass(frozen=True)
class InlineWeights:
    """Safetensors bytes carried by the update itself (workers/weights/sync.py
    ``serialize_state_dict`` makes them)."""
    data: bytes

    @property
    def size(self) -> int:
        return len(self.data)


class Barrier(Protocol):
    """A collective update as one engine sees it: what its receive RPC takes (``meta``:
    the tensors' names, shapes, dtypes and buckets) and the barrier it passes right before
    receiving (the trainer sends once every engine has passed it)."""

    @property
    def meta(self) -> dict[str, Any]: ...

    async def arrive(self) -> None: ...


@dataclass(frozen=True)
class BroadcastWeights:
    """One broadcast of the trainer's weight group (rollout.weight_transport collective)."""
    group: Barrier


WeightUpdate = Union[FileWeights, InlineWeights, BroadcastWeights]
