"""Tensor <-> protobuf: raw little-endian bytes, dtype name and shape (no pickling)."""

import torch

from tandem.errors import InvalidArgument
from tandem.v1 import engine_pb2 as pb

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "int32": torch.int32, "int64": torch.int64}  # integers: index tensors
_NAMES = {v: k for k, v in _DTYPES.items()}


def tensor_to_pb(t: torch.Tensor) -> pb.Tensor:
    t = t.detach().contiguous().cpu()
    # bf16 has no numpy dtype: ship its bits as int16.
    raw = t.view(torch.int16) if t.dtype == torch.bfloat16 else t
    return pb.Tensor(dtype=_NAMES[t.dtype], shape=list(t.shape), data=raw.numpy().tobytes())


def tensor_from_pb(m: pb.Tensor, device: torch.device | str = "cpu") -> torch.Tensor:
    if m.dtype not in _DTYPES:
        raise InvalidArgument(f"tensor dtype {m.dtype!r} is not one of {sorted(_DTYPES)}")
    dtype = _DTYPES[m.dtype]
    storage = torch.int16 if dtype == torch.bfloat16 else dtype
    width = storage.itemsize
    if len(m.data) != _numel(m.shape) * width or any(d < 0 for d in m.shape):
        raise InvalidArgument(f"tensor of shape {list(m.shape)} has {len(m.data)} bytes of {m.dtype}")
    # frombuffer refuses an empty buffer: an empty tensor is valid (and a peer may send one).
    flat = torch.frombuffer(bytearray(m.data), dtype=storage) if m.data else torch.empty(0, dtype=storage)
    return flat.view(dtype).reshape(tuple(m.shape)).to(device)


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
